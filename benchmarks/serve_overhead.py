"""What the server adds to the engine: the same requests offline and through `pagellm serve`.

    python benchmarks/serve_overhead.py [--streams 1 8 32] [--prompt-len 256] [--output-len 128]
        [--out benchmarks/results/serve_overhead.jsonl] [engine flags: --model PATH, --dtype ...]

For each stream count N, N requests (random token ids, greedy, exactly --output-len tokens
each) run twice:
- offline: added to an LLMEngine at once and stepped to the end in this process, noting
  when each request's tokens leave a step (pagellm/bench/offline_streams.py);
- online: sent at once, streaming, to a `pagellm serve` started with the same engine flags,
  by `pagellm bench serve`'s client (httpx, one connection per stream, in this process),
  greedy as well (temperature 0).
Both sides are summarized by the same code (TTFT, ITL, TPOT, output tok/s), and the table
gives their ratios: online ITL / offline ITL, online output tok/s / offline, online TTFT -
offline TTFT. Each side first runs a warm-up round (the kernels' first-step measurements
are not charged to either), then --rounds measured rounds, offline and online alternating
so that a drifting machine slows both alike; every round has new prompts, so no prefix is
cached. Only one side computes at a time: the idle engine's threads sleep. Prints a
table of the medians and appends one JSON line per stream count to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.offline_streams import measure_offline
from pagellm.bench.server_process import ServerProcess
from pagellm.bench.serve_load import ServeBenchConfig, run_requests
from pagellm.bench.serve_metrics import summarize
from pagellm.config.cli_args import add_engine_args, engine_args_from_namespace, engine_args_to_cli
from pagellm.engine.llm_engine import LLMEngine
from pagellm.workload.synthetic import WorkloadSpec, make_workload

KEYS = ("ttft_ms_median", "itl_ms_median", "itl_ms_p90", "tpot_ms_median", "output_tok_s")


def workload(args: argparse.Namespace, num_requests: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """`num_requests` prompts of random ids below the model's vocabulary size."""
    spec = WorkloadSpec(kind="fixed", num_requests=num_requests, prompt_len=(args.prompt_len, args.prompt_len),
                        output_len=(args.output_len, args.output_len), seed=seed,
                        vocab_high=min(30_000, args.vocab_size))  # fmt: skip
    requests = make_workload(spec)
    return [r.prompt_token_ids for r in requests], [r.output_len for r in requests]


def pick(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: summary.get(key) for key in KEYS} | {"failed": summary["failed"]}


# ---------------------------------------------------------------------- offline


def offline_round(engine: LLMEngine, args: argparse.Namespace, n: int, seed: int) -> dict[str, Any]:
    prompts, output_lens = workload(args, n, seed)
    run = measure_offline(engine, prompts, output_lens, f"offline-{seed}")
    return pick(summarize(run.records, run.duration_s))


# ----------------------------------------------------------------------- online


def start_server(args: argparse.Namespace) -> ServerProcess:
    """`pagellm serve` with the benchmark's engine flags."""
    serve_args = ["--disable-log-stats", *engine_args_to_cli(engine_args_from_namespace(args))]
    return ServerProcess(serve_args, start_timeout_s=600)


def online_round(server: ServerProcess, args: argparse.Namespace, n: int, seed: int) -> dict[str, Any]:
    config = ServeBenchConfig(base_url=server.url, max_concurrency=n, extra_body={"temperature": 0.0})
    prompts, output_lens = workload(args, n, seed)
    run = asyncio.run(run_requests(config, prompts, output_lens, [len(p) for p in prompts]))
    return pick(summarize(run.records, run.duration_s))


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    result = {}
    for key in KEYS:
        values = sorted(r[key] for r in rounds if r[key] is not None)
        result[key] = values[len(values) // 2] if values else None
    result["failed"] = sum(r["failed"] for r in rounds)
    result["rounds"] = rounds
    return result


def run_both(args: argparse.Namespace) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Offline and online rounds alternate, so that a machine whose speed drifts during
    the run (shared hosts do) slows both sides alike; each side's median is reported."""
    engine = LLMEngine.from_engine_args(engine_args_from_namespace(args))
    args.vocab_size = engine.config.model_config.vocab_size
    server = start_server(args)
    offline, online = {}, {}
    try:
        for n in args.streams:
            # Warm-up: the kernels' first-step measurements at this batch size, both sides.
            offline_round(engine, args, n, seed=10_000 + n)
            online_round(server, args, n, seed=20_000 + n)
            off_rounds, on_rounds = [], []
            for i in range(args.rounds):
                # New prompts every round: no prefix-cache hit in either engine.
                off_rounds.append(offline_round(engine, args, n, seed=1000 * i + n))
                on_rounds.append(online_round(server, args, n, seed=1000 * i + n))
                print(f"{n} streams, round {i + 1}: offline {off_rounds[-1]}, online {on_rounds[-1]}", flush=True)
            offline[n], online[n] = medians(off_rounds), medians(on_rounds)
    finally:
        server.stop()
        engine.close()
    return offline, online


# ----------------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def difference(a: float | None, b: float | None) -> float | None:
    return round(a - b, 1) if a is not None and b is not None else None


def paired(offline_rounds: list[dict[str, Any]], online_rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of each round's online/offline ITL ratio, TTFT difference
    and tok/s ratio."""

    def median_of(values: list[float | None]) -> float | None:
        known = sorted(v for v in values if v is not None)
        return known[len(known) // 2] if known else None

    pairs = list(zip(offline_rounds, online_rounds, strict=True))
    return {
        "itl_ratio": median_of([ratio(on["itl_ms_median"], off["itl_ms_median"]) for off, on in pairs]),
        "ttft_added_ms": median_of([difference(on["ttft_ms_median"], off["ttft_ms_median"]) for off, on in pairs]),
        "output_tok_s_ratio": median_of([ratio(on["output_tok_s"], off["output_tok_s"]) for off, on in pairs]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side and stream count")
    parser.add_argument("--out", default="benchmarks/results/serve_overhead.jsonl")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    cpu = cpu_info()
    print(f"CPU: {describe_cpu(cpu)}", flush=True)
    offline, online = run_both(args)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print("\n| streams | offline ITL ms | online ITL ms | ITL ratio | offline TTFT ms | online TTFT ms | "
          "TTFT added ms | offline tok/s | online tok/s | tok/s ratio |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    pairs: list[tuple[int, dict[str, Any]]] = []
    with open(args.out, "a") as f:
        for n in args.streams:
            off, on = offline[n], online[n]
            row = {
                "bench": "serve_overhead", "time": stamp, "cpu": cpu, "streams": n,
                "prompt_len": args.prompt_len, "output_len": args.output_len,
                "engine_flags": engine_args_to_cli(engine_args_from_namespace(args)),
                "offline": off, "online": on,
                "itl_ratio": ratio(on["itl_ms_median"], off["itl_ms_median"]),
                "output_tok_s_ratio": ratio(on["output_tok_s"], off["output_tok_s"]),
                "ttft_added_ms": difference(on["ttft_ms_median"], off["ttft_ms_median"]),
                # Each round's online figure against the offline round just before it, then
                # the median: a machine whose speed drifts between rounds (this one's
                # offline prefill varied 716-889 ms) moves both sides of a pair alike.
                "paired": paired(off["rounds"], on["rounds"]),
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")
            cells = [off["itl_ms_median"], on["itl_ms_median"], row["itl_ratio"], off["ttft_ms_median"],
                     on["ttft_ms_median"], row["ttft_added_ms"], off["output_tok_s"], on["output_tok_s"],
                     row["output_tok_s_ratio"]]  # fmt: skip
            print(f"| {n} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells) + " |")
            pairs.append((n, row["paired"]))
    print("\nPaired by round (each online round against the offline round before it), medians:")
    for n, pair in pairs:
        print(f"  {n} streams: ITL ratio {pair['itl_ratio']}, TTFT added {pair['ttft_added_ms']} ms, "
              f"tok/s ratio {pair['output_tok_s_ratio']}")
    failed = sum(offline[n]["failed"] + online[n]["failed"] for n in args.streams)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
