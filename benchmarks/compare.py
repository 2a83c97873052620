"""Run pagellm and its peers on the same workloads in one run; write a markdown table.

Each measurement is a `pagellm bench throughput` subprocess (a clean process per backend,
so one backend's memory or threads never affect another), all on the same request list
(same seed), one after the other on this machine. Ratios are taken within this run only.

    python benchmarks/compare.py --out benchmarks/results/compare.md
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagellm.bench.machine import cpu_info, describe_cpu

# The embedded GGUF's weights as pagellm runs them by default in bf16 (--quantization auto)
# and dequantized to bf16 (--quantization none, the path before weights stayed quantized).
AS_STORED = ("pagellm", "bfloat16", [], "bfloat16 (Q4_1/Q8_0 as stored)")
DEQUANTIZED = ("pagellm", "bfloat16", ["--quantization", "none"], "bfloat16 (dequantized)")
# vLLM's CPU build on the HF folder written from the GGUF (float32 weights, which vLLM runs in
# bf16 by default on CPU): equal work with pagellm bf16 (dequantized). Its own environment
# (installed on first use: pagellm/bench/peers.py).
VLLM = ("vllm", "bfloat16", [], "bfloat16 (vLLM, HF folder)")
PEER_BACKENDS = ("llamacpp", "openvino", "vllm")  # pagellm's --dtype is not theirs

SCENARIOS = {
    # name: (workload flags, [(backend, dtype, extra flags[, label])])
    "mixed": (
        ["--workload", "mixed", "--num-requests", "64", "--prompt-len", "16", "256", "--output-len", "16", "256"],
        [
            ("pagellm", "float32", []),
            ("hf", "float32", ["--hf-batch-sizes", "16", "32", "64"]),
            AS_STORED,
            DEQUANTIZED,
            ("hf", "bfloat16", ["--hf-batch-sizes", "32", "64"]),
            ("llamacpp", "gguf", ["--llamacpp-parallel", "64"]),
            ("llamacpp", "bfloat16", ["--llamacpp-parallel", "64", "--llamacpp-weights", "bfloat16"]),
            # OpenVINO GenAI's ContinuousBatchingPipeline on the same GGUF, its defaults, in its
            # own environment (installed on first use: pagellm/bench/peers.py).
            ("openvino", "gguf", []),
            VLLM,
        ],
    ),
    "prefill-only": (
        # Prompts only (one output token each): the batched path, where AMX through oneDNN counts.
        ["--workload", "mixed", "--num-requests", "64", "--prompt-len", "24", "300", "--output-len", "1", "1"],
        [AS_STORED, ("hf", "bfloat16", ["--hf-batch-sizes", "16", "32"])],
    ),
    "single-stream": (
        # One request takes about a second: the median of 5 runs, for every backend alike.
        ["--workload", "fixed", "--num-requests", "1", "--prompt-len", "16", "16", "--output-len", "128", "128",
         "--repeats", "5"],
        [
            AS_STORED,
            DEQUANTIZED,
            ("pagellm", "float32", []),
            ("llamacpp", "gguf", ["--llamacpp-parallel", "1"]),
            ("llamacpp", "bfloat16", ["--llamacpp-parallel", "1", "--llamacpp-weights", "bfloat16"]),
            ("openvino", "gguf", []),
            VLLM,
        ],
    ),
    "large-batch-decode": (
        ["--workload", "fixed", "--num-requests", "128", "--prompt-len", "16", "16", "--output-len", "128", "128"],
        [AS_STORED, DEQUANTIZED, ("pagellm", "float32", [])],
    ),
}


def run_one(workload: list[str], backend: str, dtype: str, extra: list[str], result_file: Path, label: str) -> dict:
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "throughput", "--backend", backend,
               *workload, *extra, "--result-file", str(result_file), "--json"]  # fmt: skip
    if backend not in PEER_BACKENDS:
        command += ["--dtype", dtype]
    print("$", " ".join(command[1:]), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        if proc.returncode < 0:  # the backend's process died (llama.cpp runs in one of its own)
            error = f"killed by signal {signal.Signals(-proc.returncode).name}"
        else:
            error = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return {"backend": backend, "dtype": label, "error": error}
    record = json.loads(proc.stdout)  # --json: stdout is the record alone
    record["dtype"] = label
    print(f"  -> {record['output_tok_s']} output tok/s, {record['achieved_gflop_s']} GFLOP/s, "
          f"agreement {agreement_cell(record)}", flush=True)
    return record


def agreement_cell(record: dict) -> str:
    """The fraction of leading greedy tokens that match the HF float32 reference."""
    agreement = record.get("agreement")
    if not agreement:
        return "not checked"
    if agreement.get("fraction") is None:
        return "no reference"
    return f"{agreement['fraction']:.2f}"


def rss_cell(record: dict) -> str:
    """The backend's peak resident memory (peers: summed over their processes), in MiB."""
    peak = record.get("peak_rss_bytes")
    return f"{peak / 2**20:.0f} MiB" if peak else ""


def render(results: dict[str, list[dict]], machine: str, cpu: dict, measured: str | None = None) -> str:
    measured = measured or time.strftime("%Y-%m-%d %H:%M")
    lines = [f"Measured {measured} on {machine}, CPU {describe_cpu(cpu)}, "
             "SmolLM2-135M-Instruct.", ""]  # fmt: skip
    for scenario, records in results.items():
        workload, _ = SCENARIOS[scenario]
        lines += [f"### {scenario}: `{' '.join(workload)}`", ""]
        lines += ["| backend | dtype | output tok/s | total tok/s | GFLOP/s (of ceiling) | agreement | peak RSS | pagellm / this |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        best_pagellm = {r["dtype"]: r["output_tok_s"] for r in records if r.get("backend") == "pagellm" and "error" not in r}
        best_any = max(best_pagellm.values(), default=None)
        for r in records:
            if "error" in r:
                lines.append(f"| {r['backend']} | {r['dtype']} | failed: {r['error']} | | | | | |")
                continue
            name = r["backend"]
            if r.get("settings", {}).get("batch_size"):
                name += f" (best batch {r['settings']['batch_size']})"
            if r["backend"] == "llamacpp":
                name += f" ({r['settings'].get('parallel')} seqs)"
            if r["backend"] in ("llamacpp", "vllm") and r["dtype"] != "gguf":  # equal work: both on bf16 weights
                reference = best_pagellm.get(DEQUANTIZED[3], best_any)
            elif r["dtype"] == "bfloat16":  # HF in bf16 against pagellm's default bf16 path
                reference = best_pagellm.get(AS_STORED[3], best_any)
            elif r["backend"] in ("llamacpp", "openvino"):  # the GGUF as stored against pagellm's default
                reference = best_pagellm.get(AS_STORED[3], best_any)
            else:
                reference = best_pagellm.get(r["dtype"], best_any)
            ratio = f"{reference / r['output_tok_s']:.2f}x" if reference and r["backend"] != "pagellm" else ""
            lines.append(
                f"| {name} | {r['dtype']} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
                f"{r['achieved_gflop_s']:.0f} of {r['matmul_ceiling_gflop_s']:.0f} "
                f"({100 * r['fraction_of_ceiling']:.0f}%) | {agreement_cell(r)} | {rss_cell(r)} | {ratio} |"
            )
            for s in r.get("sweep", []):
                lines.append(f"| &nbsp;&nbsp;HF batch {s['batch_size']} | {r['dtype']} | {s['output_tok_s']} | | | | | |")
        lines.append("")
    lines.append("pagellm bfloat16 (Q4_1/Q8_0 as stored) is the default: the GGUF's quantized weights "
                 "stay as stored and the kernels read them (--quantization auto); (dequantized) converts "
                 "them to bf16 at load (--quantization none). llama.cpp (gguf) runs the GGUF as stored "
                 "and is compared with pagellm's best; llama.cpp (bfloat16) runs the same weights "
                 "dequantized to BF16, equal work with pagellm bf16 (dequantized), as is vLLM (its CPU build on an HF "
                 "folder written from the GGUF, run in its default bf16). Peak RSS: of the process that ran the "
                 "backend (pagellm and HF: the whole benchmark process; vLLM: the sum over its frontend, engine "
                 "and worker processes, an upper bound). GFLOP/s counts the matmul "
                 "FLOPs of the work asked for. Agreement: the fraction of the first 16 greedy tokens of "
                 "the first 4 requests that match HF transformers in float32 (up to the first mismatch).")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--skip", nargs="*", default=[], help="backends to skip (e.g. llamacpp)")
    parser.add_argument("--out", default="benchmarks/results/compare.md")
    parser.add_argument("--render", action="store_true", help="only rewrite the table from the .jsonl beside --out")
    args = parser.parse_args()
    if args.render:
        out = Path(args.out)
        records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
        rendered: dict[str, list[dict]] = {}
        for scenario, (workload, _) in SCENARIOS.items():
            kind, count = workload[1], workload[workload.index("--num-requests") + 1]
            rendered[scenario] = [
                r for r in records
                if r.get("workload", {}).get("kind") == kind and str(r["workload"].get("num_requests")) == count
            ]  # fmt: skip
        machine = next((r["machine"] for r in records if "machine" in r), "")
        started = min(r["time"] for r in records if "time" in r).replace("T", " ")[:16]
        out.write_text(render(rendered, machine, cpu_info(), measured=f"{started} (run started)"))
        print(out.read_text())
        return 0
    results: dict[str, list[dict]] = {}
    machine = ""
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in args.scenarios:
            workload, runs = SCENARIOS[scenario]
            results[scenario] = []
            for backend, dtype, extra, *label in runs:
                if backend in args.skip:
                    continue
                record = run_one(workload, backend, dtype, extra, Path(tmp) / "r.jsonl", label[0] if label else dtype)
                machine = record.get("machine", machine)
                results[scenario].append(record)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    out.write_text(render(results, machine, cpu))
    (out.with_suffix(".jsonl")).write_text("".join(json.dumps(r) + "\n" for rs in results.values() for r in rs))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
