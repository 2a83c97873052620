"""Bench stage: tensor parallelism on the CPU: what TP=2 adds to a decode step against
TP=1, and where it goes (benchmarks/tp_overhead.py is its command line).

The embedded SmolLM2-135M (9 heads, 3 KV heads) is not split by TP=2, so the default model
is a synthetic HF checkpoint of SmolLM2-like size that is: hidden 512, 8 heads / 4 KV heads
(head_dim 64), intermediate 1536, vocabulary 49152, tied embeddings, 30 layers (--layers
and friends change it); only config.json and a byte tokenizer are written, to a temporary
folder, and the engine draws random weights (load_format "dummy").

1. Steps. One LLM per TP degree (1, then 2), both alive at once. TP=1 runs on all
   --threads (torch's default); TP=2's ranks get threads // 2 each, as the engine splits
   them. For each decode batch size B (1, 32): B requests (random prompts, ignore_eos, long
   max_tokens) are added to both engines and stepped until every one is prefilled; then
   the timed engine.step() calls, every one a pure decode step of exactly B rows (checked
   on each SchedulerOutput), alternate between the engines in blocks of --block-steps, so a
   busy machine slows both alike. Reported per step: mean / median / min, the time inside
   executor.execute_model and what the engine spends around it (schedule, update, outputs).
2. Breakdown (TP=2). The driver's DistributedTPGroup (llm.engine.executor.driver.tp) has
   all_reduce, gather_vocab and broadcast_from_driver wrapped by timers (instance
   attributes set here; pagellm is not changed): per-step totals, calls per step, the
   tensor sizes they carry, and the pickled size of each step message (pickle.dumps of
   the broadcast object, as broadcast_object_list pickles it; that pickling is timed and
   taken off the step time). A collective timed on the driver includes waiting for the
   other rank to arrive, so it is compared with the same collective alone (3).
3. Collectives alone. Two spawned processes (1 thread each) join a gloo group and time
   all_reduce at the sizes the model used (B x hidden x dtype bytes) plus 4 MiB, all_gather
   at the LM head's share, and broadcast_object_list of a payload the size of the step
   messages, in rounds over all of them: microseconds per call and achieved bus bandwidth
   (all_reduce: 2(n-1)/n x bytes / time, the ring's traffic per rank; all_gather: (n-1)/n
   x gathered bytes / time; broadcast: payload bytes / time). The driver's all-reduces
   inside a step get the same bus figure from their time per call.

Prints the configuration, the CPU, tables and one JSON line; writes
benchmarks/results/tp_overhead.json (the JSON line) and tp_overhead.md (the tables).
The parts: tp_overhead_steps.py (1, 2), tp_overhead_collectives.py (3),
tp_overhead_report.py (the comparison and the tables).
On a machine with few cores TP=2 splits the same cores between two processes, so it
cannot be faster than TP=1; the point is the overhead figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.results import write_result_files
from pagellm.bench.tp_overhead_collectives import DTYPES, collectives_plan, run_collectives
from pagellm.bench.tp_overhead_report import comparison_rows, format_tables, notes
from pagellm.bench.tp_overhead_steps import TP_SIZES, run_engines, synthetic_checkpoint

# Relative to where the command runs, the repository root; benchmarks/tp_overhead.py passes
# its own folder's results/, so a run from elsewhere writes where the docs say.
RESULTS_DIR = Path("benchmarks") / "results"
LARGE_ALL_REDUCE_BYTES = 4 << 20
# SmolLM2-135M's size, with heads that two ranks split (SmolLM2 has 9 / 3).
DEFAULT_SHAPE = {"layers": 30, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1536, "vocab": 49152}
QUICK = {"steps": 8, "warmup": 2, "block_steps": 4, "prompt_len": 16, "micro_iters": 40}
FULL = {"steps": 48, "warmup": 4, "block_steps": 4, "prompt_len": 64, "micro_iters": 300}


def parse_args(argv: list[str] | None = None, results_dir: Path = RESULTS_DIR) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-step overhead of tensor parallelism (TP=2 against TP=1) on the CPU, with the driver's "
        "communication broken down and gloo collectives timed alone.",
    )
    parser.add_argument("--model", default=None, help="HF folder or GGUF file (default: a synthetic checkpoint)")
    parser.add_argument("--load-format", default=None, help="default: dummy for the synthetic model, else auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (float32)")
    for key, value in DEFAULT_SHAPE.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=f"model shape ({value})")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], help="decode batch sizes (1 32)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="total CPU threads (torch's default, here %(default)s)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a smoke run: " + json.dumps(QUICK))
    parser.add_argument("--steps", type=int, default=None, help=f"timed decode steps per TP and B ({FULL['steps']})")
    parser.add_argument("--warmup", type=int, default=None, help=f"untimed decode steps first ({FULL['warmup']})")
    parser.add_argument("--block-steps", type=int, default=None,
                        help=f"steps per alternation block ({FULL['block_steps']})")  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=None, help=f"prompt tokens ({FULL['prompt_len']})")
    parser.add_argument("--micro-iters", type=int, default=None,
                        help=f"calls per small collective ({FULL['micro_iters']}; big ones a tenth)")  # fmt: skip
    parser.add_argument("--no-engine", action="store_true", help="only the collectives alone")
    parser.add_argument("--no-collectives", action="store_true", help="skip the collectives alone")
    parser.add_argument("--out", type=Path, default=results_dir / "tp_overhead.json",
                        help="JSON file; the tables go beside it as .md (%(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.load_format is None:
        args.load_format = "auto" if args.model else "dummy"
    return args


def main(argv: list[str] | None = None, results_dir: Path = RESULTS_DIR) -> None:
    args = parse_args(argv, results_dir)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    config = {
        "model": args.model or "synthetic", "load_format": args.load_format, "dtype": args.dtype,
        "shape": None if args.model else {k: getattr(args, k) for k in DEFAULT_SHAPE},
        "batch_sizes": args.batch_sizes, "tp_sizes": list(TP_SIZES), "threads": args.threads,
        "cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)), "steps": args.steps,
        "warmup": args.warmup, "block_steps": args.block_steps, "prompt_len": args.prompt_len,
        "micro_iters": args.micro_iters, "quick": args.quick, "torch": torch.__version__,
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    print("config:", ", ".join(f"{k}={v}" for k, v in config.items()))
    print("cpu:", describe_cpu(cpu))
    started = time.perf_counter()
    engine_results: dict[str, Any] = {"rows": []}
    if not args.no_engine:
        with tempfile.TemporaryDirectory(prefix="pagellm-tp-overhead-") as folder:
            model = args.model or str(synthetic_checkpoint(Path(folder), args))
            engine_results = run_engines(model, args)
    rows = engine_results["rows"]
    collectives: list[dict[str, Any]] = []
    if not args.no_collectives:
        reduce_shapes, gather_shapes, messages = [], [], []
        for r in rows:
            if r["tp"] == 2:
                reduce_shapes += [(t["shape"], t["dtype"]) for t in r["all_reduce"]["tensors"]]
                gather_shapes += [(t["shape"], t["dtype"]) for t in r["gather_vocab"]["tensors"]]
                messages.append(r["broadcast"]["message_bytes"]["median"])
        if not rows:  # no engine run: the sizes the synthetic model's steps would use
            reduce_shapes = [([b, args.hidden], args.dtype) for b in args.batch_sizes]
            gather_shapes = [([b, -(-args.vocab // 2)], args.dtype) for b in args.batch_sizes]
            messages = [1024]
        dtype = reduce_shapes[0][1]
        large = [([LARGE_ALL_REDUCE_BYTES // DTYPES[dtype].itemsize], dtype)]
        plan = collectives_plan(reduce_shapes + large, gather_shapes, messages, args.micro_iters)
        collectives = run_collectives(plan)
    results = {
        "steps": rows,
        "comparison": comparison_rows(rows, collectives),
        "collectives": collectives,
        **{k: v for k, v in engine_results.items() if k != "rows"},
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    record: dict[str, Any] = {
        "benchmark": "tp_overhead", "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu, "config": config,
        "results": results, "wall_s": None, "notes": [],
    }  # fmt: skip
    record["notes"] = notes(record)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    tables = format_tables(record)
    print()
    print(tables)
    header = (f"# tp_overhead ({record['created']})\n\nconfig: " + ", ".join(f"{k}={v}" for k, v in config.items())
              + f"\n\ncpu: {describe_cpu(cpu)}\n\n")  # fmt: skip
    write_result_files(args.out, record, header + tables)
