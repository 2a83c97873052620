"""Bench stage: `pagellm bench kernels`, every linear kernel candidate of the loaded model timed
again, beside the choice the engine made at load (kernels/linear_choice.py).

For each linear group (shape x weight types) and row bucket: each candidate's time per call,
its GFLOP/s and the weight bytes it reads per second against the machine's measured
ceilings (a large bf16 matmul, a large copy), the engine's choice and the chosen
candidate's speed over the fastest of this second, independent measurement.

    pagellm bench kernels                       # the embedded SmolLM2
    pagellm bench kernels --model m.gguf --json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagellm.workload.command_output import add_output_args, emit_result


def add_bench_kernels_parser(bench_commands: "argparse._SubParsersAction") -> None:
    p = bench_commands.add_parser("kernels", help="time every linear kernel candidate of a model, beside the choice")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2)")
    add_output_args(p)
    p.set_defaults(run_command=run_bench_kernels)


def run_bench_kernels(args: argparse.Namespace) -> None:
    import torch

    from pagellm import LLM
    from pagellm.bench.machine import cpu_info
    from pagellm.errors import ConfigError
    from pagellm.kernels.build import describe_isa
    from pagellm.kernels.linear_choice import TIMED_ROWS, bucket_label
    from pagellm.metrics.ceilings import device_ceilings
    from pagellm.model.linear_plans import candidate_timer

    llm = LLM(args.model, dtype="bfloat16", device="cpu", max_model_len=1024, disable_log_stats=True)
    model = llm.engine.runner.model
    if model.linear_choice is None:
        raise ConfigError("this machine has no native kernels (they need x86-64 with AVX2 and a C compiler): nothing to choose")
    ceilings = device_ceilings("cpu", torch.bfloat16)
    kernel = model.cpu_linear_kernels
    rows_out: list[dict[str, Any]] = []
    # The load-time choice timed a slice of each large layer; the check times the whole.
    time_candidate = candidate_timer(model.linear_groups, kernel, whole_layers=True)
    with torch.inference_mode():
        for group in model.linear_groups:
            module = group.module
            weight_bytes = module.packed.nbytes if module.packed is not None else module.weight.numel() * 2
            plan = model.linear_choice.plans[group.shape.key]
            for bucket, rows in enumerate(TIMED_ROWS):
                times = {impl: time_candidate(group.shape, rows, impl) for impl in group.shape.candidates}
                fastest = min(times.values())
                chosen = plan.choices[bucket]
                flops = 2.0 * rows * group.shape.n * group.shape.k
                rows_out.append({
                    "group": group.label,
                    "bucket": bucket_label(bucket),
                    "rows": rows,
                    "candidates": {
                        impl.label: {
                            "us": t * 1e6,
                            "gflops": flops / t / 1e9,
                            "weight_gbps": weight_bytes / t / 1e9,
                        }
                        for impl, t in times.items()
                    },
                    "chosen": chosen.label,
                    "chosen_over_fastest": fastest / times[chosen],
                })  # fmt: skip
    result = {
        "benchmark": "kernels",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_info(),
        "isa": describe_isa(),
        "threads": kernel.num_threads,
        "choice_source": model.linear_choice.source,
        "choice_seconds": model.linear_choice.seconds,
        "choice_others_cpu_share": model.linear_choice.others_share,
        "ceilings": {"bf16_matmul_gflops": ceilings.flops_per_s / 1e9, "copy_gbps": ceilings.bytes_per_s / 1e9},
        "rows": rows_out,
        "worst_chosen_over_fastest": min(r["chosen_over_fastest"] for r in rows_out),
    }
    emit_result(result, lambda record: print(_table(record)), args.json, args.result_file)


def _table(result: dict[str, Any]) -> str:
    ceilings = result["ceilings"]
    lines = [
        f"linear kernels on {result['isa']}, {result['threads']} threads; choice: {result['choice_source']}",
        f"ceilings: {ceilings['bf16_matmul_gflops']:.0f} GFLOP/s bf16 matmul, {ceilings['copy_gbps']:.1f} GB/s copy",
        "",
        "| group | rows | candidate: us (GFLOP/s, weight GB/s) | chosen | chosen / fastest |",
        "|---|---:|---|---|---:|",
    ]
    for row in result["rows"]:
        cells = "; ".join(
            f"{name}: {c['us']:.0f} ({c['gflops']:.0f}, {c['weight_gbps']:.1f})" for name, c in row["candidates"].items()
        )
        lines.append(f"| {row['group']} | {row['bucket']} | {cells} | {row['chosen']} | {row['chosen_over_fastest']:.2f} |")
    lines.append(f"\nworst chosen / fastest: {result['worst_chosen_over_fastest']:.2f}")
    return "\n".join(lines)
