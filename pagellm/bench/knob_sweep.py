"""Bench stage: the prefill/decode balance knobs on one workload near capacity.

Each setting (a profile, a knob, a policy) runs the same request list, arriving at a
fixed rate, on a fresh real engine (in-process, so the measurement is the engine's own,
with no HTTP in between); throughput, p99 TTFT and p99 ITL per setting go into a JSONL
file and a PNG chart of throughput against each latency.

    pagellm bench knobs --request-rate 3 --num-requests 90 --out-dir benchmarks/results/knobs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from pagellm.workload.synthetic import add_workload_args, workload_spec_from_args

logger = logging.getLogger(__name__)

# name -> engine arguments; the first is the reference the others are compared with.
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "interactive": {"profile": "interactive"},
    "offline": {"profile": "offline"},
    "prefill-share-0.25": {"prefill_share": 0.25},
    "one-partial-cap-128": {"max_num_partial_prefills": 1, "long_prefill_token_threshold": 128},
    "budget-256": {"max_num_batched_tokens": 256},
    "shortest-remaining": {"scheduling_policy": "shortest-remaining"},
}


def add_bench_knobs_parser(bench_commands: "argparse._SubParsersAction") -> None:
    p = bench_commands.add_parser("knobs", help="sweep the prefill/decode balance knobs at a fixed request rate")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--request-rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--out-dir", default="bench-results/knobs", help="JSONL results and knobs.png")
    add_workload_args(p)
    p.set_defaults(run_command=run_bench_knobs)


def run_bench_knobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pagellm.config.engine_args import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.sim.real_run import run_on_engine
    from pagellm.sim.report import summarize_sim
    from pagellm.sim.request_stream import SyntheticWorkload, make_synthetic_requests

    from pagellm.model.checkpoint import load_model_config, resolve_model_source

    spec = workload_spec_from_args(args)
    # Prompt ids must exist in this model's vocabulary.
    vocab_size = load_model_config(resolve_model_source(args.model)).vocab_size
    high = min(spec.vocab_high, vocab_size)
    spec = dataclasses.replace(spec, vocab_high=high, vocab_low=min(spec.vocab_low, high // 2))
    requests = make_synthetic_requests(
        SyntheticWorkload(spec, request_rate=args.request_rate, burstiness=args.burstiness),
        max_model_len=args.max_model_len,
    )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for name in args.settings:
        engine_args = EngineArgs(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, disable_log_stats=True, **SETTINGS[name]
        )
        engine = LLMEngine.from_engine_args(engine_args)
        _warm_up(engine)
        measured = run_on_engine(engine, requests)
        summary = summarize_sim(measured.result)
        config = engine.scheduler.scheduler_config
        record = {
            "bench": "knobs",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "setting": name,
            "engine_args": SETTINGS[name],
            "resolved": {
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "max_num_partial_prefills": config.max_num_partial_prefills,
                "long_prefill_token_threshold": config.long_prefill_token_threshold,
                "prefill_share": config.prefill_share,
                "scheduling_policy": config.scheduling_policy,
            },
            "request_rate": args.request_rate,
            "num_requests": len(requests),
            "completed": summary["completed"],
            "rejected": summary["rejected"],
            "output_tok_s": summary["output_tok_s"],
            "ttft_p50_ms": summary["ttft_ms_median"],
            "ttft_p99_ms": summary["ttft_ms_p99"],
            "itl_p50_ms": summary["itl_ms_median"],
            "itl_p99_ms": summary["itl_ms_p99"],
            "e2el_p50_ms": summary["e2el_ms_median"],
        }
        engine.close()
        records.append(record)
        print(json.dumps(record), flush=True)
    with open(out_dir / "knobs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(render_table(records))
    chart = draw_chart(records, out_dir / "knobs.png")
    print(f"chart: {chart}")
    return records


def _warm_up(engine: Any) -> None:
    """One short request first, so one-time costs (kernel build, allocator) are not timed."""
    from pagellm.sampling_params import SamplingParams

    engine.add_request("warm-up", list(range(100, 132)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def render_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | completed |",
        "|---|---:|---:|---:|---:|",
    ]
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for r in records:
        lines.append(
            f"| {r['setting']} | {r['output_tok_s'] or 0:.1f} | {ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])} | "
            f"{ms(r['itl_p50_ms'])} / {ms(r['itl_p99_ms'])} | {r['completed']}/{r['num_requests']} |"
        )
    return "\n".join(lines)


def draw_chart(records: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, key, label in ((axes[0], "ttft_p99_ms", "p99 TTFT (ms)"), (axes[1], "itl_p99_ms", "p99 ITL (ms)")):
        for r in records:
            if r[key] is None:
                continue
            axis.scatter(r[key], r["output_tok_s"], s=40)
            axis.annotate(r["setting"], (r[key], r["output_tok_s"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        axis.set_xlabel(label)
        axis.set_ylabel("output tokens/s")
        axis.grid(alpha=0.3)
    rate = records[0]["request_rate"] if records else 0
    fig.suptitle(f"Prefill/decode knobs at {rate:g} requests/s (same workload each)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
