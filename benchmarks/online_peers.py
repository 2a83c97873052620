"""Online comparison: pagellm's server against vLLM's (CPU build) on the same model, loaded
by `pagellm bench serve`'s generator at several concurrencies; a JSON lines result and a
table with ratios against pagellm.

Each engine in turn: its server starts on a free port (pagellm serve on the GGUF with its
defaults; vLLM serve on the HF folder written once from the GGUF, in its own environment:
pagellm/bench/peers.py, pagellm/bench/peer_server.py), a few warm-up requests go to it, then
for each --concurrency the same synthetic request list for that level (random token-id
prompts, fixed output length, greedy, end of sequence ignored; a new seed per level, the
same for every engine, so that no level reuses the previous level's prefixes) runs with at
most that many requests in flight. Recorded per level: output tok/s, TTFT and ITL
median / p90 / p99, and the server's peak resident memory so far (VmHWM of its processes,
summed). The server is then stopped (SIGINT, then killed with all it started).

OpenVINO is compared offline only (benchmarks/compare.py): its server, OpenVINO Model
Server, ships as a container or a binary archive, not as a PyPI package that pip installs
into an environment here (`pip index versions ovms` and `... openvino-model-server` find
nothing; PyPI's ovmsclient is only its client), and neither OpenVINO GenAI's Python package
nor optimum-intel has an HTTP server.

    python benchmarks/online_peers.py --out benchmarks/results/online_peers.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagellm.bench.hf_folder import hf_folder_from_gguf
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.peer_server import PeerServer, free_port, process_tree_peak_rss, vllm_server_command, vllm_server_env
from pagellm.bench.peers import PEERS, peer_python
from pagellm.bench.serve_load import ServeBenchConfig, fetch_model_name, run_requests
from pagellm.bench.serve_metrics import summarize
from pagellm.bench.server_process import ServerProcess
from pagellm.errors import PagellmError
from pagellm.workload.synthetic import WorkloadSpec, make_workload

logger = logging.getLogger("online_peers")

ENGINES = ("pagellm", "vllm")
FIGURES = ("output_tok_s", "ttft_ms_median", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_median", "itl_ms_p90", "itl_ms_p99")
WARMUP_REQUESTS = 4


@contextlib.contextmanager
def started_server(engine: str, model: Path, args: argparse.Namespace) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """The engine's server, ready: (base URL, its pid, what was started); stopped on exit."""
    if engine == "pagellm":
        server = ServerProcess(["--model", str(model), "--disable-log-stats", *args.pagellm_arg],
                               start_timeout_s=args.start_timeout)  # fmt: skip
        try:
            yield server.url, server.pid, {"command": "pagellm serve --model " + str(model)}
        finally:
            server.stop()
        return
    python = peer_python(PEERS["vllm"])
    folder = hf_folder_from_gguf(model)
    port = free_port()
    env = vllm_server_env(python)
    for pair in args.vllm_env:
        key, _, value = pair.partition("=")
        env[key] = value
    command = vllm_server_command(python, folder, port, args.vllm_arg)
    with PeerServer("vllm", command, port, env=env, start_timeout_s=args.start_timeout) as peer:
        yield peer.url, peer.pid, {"command": " ".join(command[1:]), "env": env, "start_s": round(peer.start_s, 1)}


def level_workload(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[int]]:
    spec = WorkloadSpec(
        kind="mixed", num_requests=args.num_requests, prompt_len=tuple(args.prompt_len),
        output_len=(args.output_len, args.output_len), seed=seed, vocab_low=100, vocab_high=args.vocab_high,
    )  # fmt: skip
    requests = make_workload(spec)
    return [r.prompt_token_ids for r in requests], [r.output_len for r in requests]


def load(url: str, model_name: str | None, prompts: list[list[int]], output_lens: list[int], concurrency: int,
         timeout_s: float) -> dict[str, Any]:  # fmt: skip
    config = ServeBenchConfig(base_url=url, model=model_name, max_concurrency=concurrency,
                              request_timeout_s=timeout_s, extra_body={"temperature": 0.0})  # fmt: skip
    run = asyncio.run(run_requests(config, prompts, output_lens, [len(p) for p in prompts]))
    return summarize(run.records, run.duration_s)


def run_engine(engine: str, model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every concurrency level on one engine's server; a record per level (or one error)."""
    print(f"== {engine}", flush=True)
    records = []
    try:
        with started_server(engine, model, args) as (url, pid, started):
            model_name = asyncio.run(fetch_model_name(ServeBenchConfig(base_url=url)))
            prompts, lens = level_workload(args, args.seed + 999_983)
            load(url, model_name, prompts[:WARMUP_REQUESTS], lens[:WARMUP_REQUESTS], WARMUP_REQUESTS, args.request_timeout)
            for concurrency in args.concurrency:
                prompts, lens = level_workload(args, args.seed + concurrency)
                summary = load(url, model_name, prompts, lens, concurrency, args.request_timeout)
                record = {
                    "bench": "online-peers", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "engine": engine,
                    "max_concurrency": concurrency, "server": started, "peak_rss_bytes": process_tree_peak_rss(pid),
                    "workload": {"num_requests": args.num_requests, "prompt_len": list(args.prompt_len),
                                 "output_len": args.output_len, "seed": args.seed + concurrency},
                    **{k: summary[k] for k in ("num_requests", "completed", "failed", "duration_s",
                                                "output_len_mismatches", "errors")},
                    **{k: summary.get(k) for k in FIGURES},
                }  # fmt: skip
                print(f"  concurrency {concurrency}: {record['output_tok_s']} output tok/s, TTFT p50 "
                      f"{record['ttft_ms_median']} ms, ITL p50 {record['itl_ms_median']} ms, "
                      f"{record['failed']} failed", flush=True)  # fmt: skip
                records.append(record)
    except (PagellmError, RuntimeError) as e:  # ServerProcess raises RuntimeError
        print(f"  {engine} failed: {e}", file=sys.stderr, flush=True)
        records.append({"bench": "online-peers", "engine": engine, "error": str(e).splitlines()[0][:500]})
    return records


def table(records: list[dict[str, Any]], concurrencies: list[int]) -> str:
    """Markdown: one row per engine and level; ratios pagellm / engine (tok/s: >1 means
    pagellm is faster; latencies: engine / pagellm, >1 means pagellm is faster too)."""
    lines = ["| engine | concurrency | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | peak RSS | "
             "pagellm faster: tok/s, TTFT p50, ITL p50 |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    by_key = {(r["engine"], r["max_concurrency"]): r for r in records if "error" not in r}
    for r in records:
        if "error" in r:
            lines.append(f"| {r['engine']} | | failed: {r['error']} | | | | |")
    for concurrency in concurrencies:
        base = by_key.get(("pagellm", concurrency))
        for engine in ENGINES:
            r = by_key.get((engine, concurrency))
            if r is None:
                continue
            ratio = ""
            if base is not None and engine != "pagellm":
                ratio = ", ".join(_ratio(a, b) for a, b in (
                    (base["output_tok_s"], r["output_tok_s"]), (r["ttft_ms_median"], base["ttft_ms_median"]),
                    (r["itl_ms_median"], base["itl_ms_median"])))  # fmt: skip
            lines.append(
                f"| {engine} | {concurrency} | {r['output_tok_s']} | {_triple(r, 'ttft')} | {_triple(r, 'itl')} | "
                f"{r['peak_rss_bytes'] / 2**20:.0f} MiB | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def _triple(record: dict[str, Any], metric: str) -> str:
    return " / ".join(f"{record[f'{metric}_ms_{s}']:.1f}" if record[f"{metric}_ms_{s}"] is not None else "-"
                      for s in ("median", "p90", "p99"))  # fmt: skip


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else "-"


def main() -> int:
    from pagellm.model.checkpoint.default_model import default_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512], metavar=("LO", "HI"))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-high", type=int, default=30000, help="prompt ids are drawn from [100, this)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to answer")
    parser.add_argument("--pagellm-arg", action="append", default=[], help="an extra `pagellm serve` argument")
    parser.add_argument("--vllm-arg", action="append", default=[], help="an extra `vllm serve` argument")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable of the vLLM server (over peer_server.VLLM_SERVER_ENV)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/online_peers.jsonl"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    model = args.model or default_model_path()
    print(f"{model.name} on CPU {describe_cpu(cpu_info())}; OpenVINO: offline only (no pip-installable server)",
          flush=True)  # fmt: skip
    records = [r for engine in args.engines for r in run_engine(engine, model, args)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as sink:
        sink.writelines(json.dumps(r) + "\n" for r in records)
    print(table(records, args.concurrency))
    return 0 if any("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
