"""The decode comparison the synthetic-GGUF benchmarks share (hybrid_decode.py, gpt_oss_decode.py):
pagellm against llama.cpp on one file, scenario by scenario, rounds in turn.

Not run on its own: `compare_decode` takes the file and the scenarios' `pagellm bench
throughput` workloads, runs each backend --rounds times in turn (so drift hits both alike),
and returns, per scenario, each backend's median output tok/s, the median of the rounds'
ratios and the rounds themselves; `report` prints the table and writes the record.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from quant_1b import run_throughput

# The two decode scenarios: single stream (1 request, 16 prompt tokens, 64 output) and 32
# requests (16 prompt, 32 output each), as `pagellm bench throughput` workloads.
SCENARIOS = {
    "single stream": ["--workload", "fixed", "--num-requests", "1", "--prompt-len", "16", "16",
                      "--output-len", "64", "64"],
    "32 requests": ["--workload", "fixed", "--num-requests", "32", "--prompt-len", "16", "16",
                    "--output-len", "32", "32"],
}  # fmt: skip


def compare_decode(
    path: Path, scenarios: dict[str, list[str]], rounds: int, with_llamacpp: bool, ours: tuple[str, ...] = ("pagellm",)
) -> dict[str, dict[str, Any]]:
    """`ours`: pagellm's variants (run_throughput's backends: pagellm, pagellm-int8, ...);
    `ratio` is the first one's against llama.cpp, `ratios` each one's."""
    backends = [*ours] + (["llamacpp"] if with_llamacpp else [])
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for scenario, workload in scenarios.items():
            samples: dict[str, list[float]] = {b: [] for b in backends}
            for _ in range(rounds):
                for backend in backends:
                    record = run_throughput(path, backend, workload, Path(scratch) / f"{backend}.jsonl")
                    samples[backend].append(record.get("output_tok_s", float("nan")))
            row: dict[str, Any] = {b: statistics.median(v) for b, v in samples.items()}
            if with_llamacpp:
                row["ratios"] = {
                    b: statistics.median(a / c for a, c in zip(samples[b], samples["llamacpp"], strict=True)) for b in ours
                }
                row["ratio"] = row["ratios"][ours[0]]
            row["rounds"] = samples
            results[scenario] = row
            print(scenario, json.dumps(row), flush=True)
    return results


def report(path: Path, spec: dict[str, Any], cpu: dict[str, Any], results: dict[str, dict[str, Any]], out: Path) -> None:
    record = {"spec": spec, "file_mib": path.stat().st_size / 2**20, "cpu": cpu, "results": results,
              "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    print(f"\n{'scenario':<16}{'backend':<16}{'tok/s':>10}{'llama.cpp tok/s':>17}{'ratio':>8}")
    for scenario, row in results.items():
        for backend, ratio in row.get("ratios", {"pagellm": float("nan")}).items():
            print(f"{scenario:<16}{backend:<16}{row[backend]:>10.2f}{row.get('llamacpp', float('nan')):>17.2f}{ratio:>8.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
