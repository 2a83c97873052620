"""GPU check: correctness and speed of pagellm on one NVIDIA GPU (and
tensor parallelism across several, where the machine has them).

One script, under 10 minutes on an H200 with no network access, run in sections:

1. gpu tests       the test files holding `gpu`-marked tests, whole, in a subprocess
2. kernel checks   Triton attention vs the PyTorch reference (float32/float64) at real
                   head shapes, mixed batches and a long-context split-K decode
3. equality        greedy float32 tokens of pagellm (chunked prefill, preemption, prefix
                   caching) vs HF transformers `generate`, on a random-weight checkpoint
4. throughput      pagellm vs HF `generate` on a Llama-3-8B-shaped model (random bf16
                   weights), both timed over the same request list: HF in left-padded
                   static batches of the size a short sweep found fastest, only each
                   request's own output tokens counted (partial, and said so, if HF's
                   time budget ends the list early; pagellm is then also timed on the
                   requests HF did, so the ratio still compares the same work)
5. bandwidth       device copy bandwidth, and the Triton decode kernel's achieved
                   bandwidth reading the KV cache
6. roofline        a large decode step of the engine vs max(bytes / copy bandwidth,
                   FLOPs / measured bf16 matmul rate)
7. tp              tensor parallel (TP 1, 2, 4, 8 as the GPUs allow): greedy float32
                   tokens at TP > 1 equal TP = 1, decode steps timed at batch 1 and 32;
                   skipped, with its reason, with fewer than 2 CUDA GPUs

Each section is guarded (a failure is a FAILED row, the others still run) and timed; a
global deadline skips the sections whose budget no longer fits (a section the machine
cannot run, such as tp on one GPU, is skipped first, with the reason). The end is one table
(check | result | target | met) and a JSON file with every figure and the environment.

    benchmarks/gpu_check.sh                       # on the GPU machine
    python benchmarks/gpu_check.py --smoke        # the plumbing on CPU, tiny shapes
    python benchmarks/gpu_check.py --sections kernels,bandwidth --out /tmp/x.json
    python benchmarks/gpu_check.py --sections tp  # 2+ GPUs: after a full run the
                                                  # deadline seldom leaves tp its budget

--smoke (or a machine without an NVIDIA driver) runs the Triton kernels under Triton's
interpreter on CPU tensors; its figures say nothing about speed. Results go to
benchmarks/results/gpu_check.json (smoke: the temp dir; --out overrides) and, when $OUT
is set, to $OUT/gpu_check.json too. The exit status is 0 when every section ran to its
end (whether or not it met its target) or does not apply to the machine, 1 when one
failed or was skipped for time.

The sections are package code (pagellm/bench/gpu_checks/, which tests import too); this
script is their command line, run with pagellm installed (`pip install -e .`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before
# anything imports Triton (torch included, which may pull it in).
if "--smoke" in sys.argv or not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.bench.gpu_checks.runner import main  # noqa: E402

if __name__ == "__main__":
    # The checkout this script belongs to is the one checked, wherever it is run from.
    sys.exit(main(repo_root=Path(__file__).resolve().parents[1]))
