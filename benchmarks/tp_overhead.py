"""Tensor parallelism on the CPU: what TP=2 adds to a decode step against TP=1, and where it goes.

    python benchmarks/tp_overhead.py                     # synthetic Llama (30 layers), float32
    python benchmarks/tp_overhead.py --quick             # a smoke run: fewer steps (under a minute)
    python benchmarks/tp_overhead.py --dtype bfloat16
    python benchmarks/tp_overhead.py --model PATH        # an HF folder or GGUF file that TP=2 splits

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
On a machine with few cores TP=2 splits the same cores between two processes, so it
cannot be faster than TP=1; the point is the overhead figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import pickle
import queue as queue_module
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.results import write_result_files

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "tp_overhead.json"
TP_SIZES = (1, 2)
LARGE_ALL_REDUCE_BYTES = 4 << 20
ROUNDS = 10  # the collectives alone: rounds over all sizes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# SmolLM2-135M's size, with heads that two ranks split (SmolLM2 has 9 / 3).
DEFAULT_SHAPE = {"layers": 30, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1536, "vocab": 49152}
QUICK = {"steps": 8, "warmup": 2, "block_steps": 4, "prompt_len": 16, "micro_iters": 40}
FULL = {"steps": 48, "warmup": 4, "block_steps": 4, "prompt_len": 64, "micro_iters": 300}


# -- pure helpers (tests/bench/test_tp_overhead.py) -----------------------------------------


def all_reduce_bus_gbps(num_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce (nccl-tests' convention): a ring moves 2(n-1)/n of
    the buffer through every rank's link."""
    return 2 * (world_size - 1) / world_size * num_bytes / seconds / 1e9


def all_gather_bus_gbps(gathered_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all-gather: every rank receives (n-1)/n of the gathered buffer."""
    return (world_size - 1) / world_size * gathered_bytes / seconds / 1e9


def summarize_ms(seconds: list[float]) -> dict[str, float]:
    """mean / median / min / max of durations, in milliseconds."""
    return {
        "mean": round(statistics.fmean(seconds) * 1e3, 3),
        "median": round(statistics.median(seconds) * 1e3, 3),
        "min": round(min(seconds) * 1e3, 3),
        "max": round(max(seconds) * 1e3, 3),
    }


def interleaved_blocks(num_steps: int, block_steps: int, names: list[str]) -> list[tuple[str, int]]:
    """(name, steps) blocks that give every name `num_steps` steps, alternating names block
    by block and rotating which goes first each round, so neither always follows the other."""
    plan: list[tuple[str, int]] = []
    done, round_index = 0, 0
    while done < num_steps:
        count = min(block_steps, num_steps - done)
        shift = round_index % len(names)
        plan += [(name, count) for name in names[shift:] + names[:shift]]
        done += count
        round_index += 1
    return plan


def is_pure_decode(num_scheduled_tokens: dict[str, int], batch_size: int) -> bool:
    """A step that runs exactly `batch_size` requests, one token each."""
    return len(num_scheduled_tokens) == batch_size and all(n == 1 for n in num_scheduled_tokens.values())


class CallTimer:
    """Wraps a callable: total seconds inside it, number of calls, and (where the first
    argument is a tensor) the distinct (bytes, dtype, shape) it was called with."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0
        self.tensor_sizes: dict[tuple[int, str, tuple[int, ...]], int] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            t = args[0]
            key = (t.nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            self.tensor_sizes[key] = self.tensor_sizes.get(key, 0) + 1
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


class MessageTimer(CallTimer):
    """A CallTimer for broadcast_from_driver that also records the pickled size of each
    message; the pickling is timed apart (it is the benchmark's, not the engine's work)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__(fn)
        self.message_bytes: list[int] = []
        self.pickle_seconds = 0.0

    def __call__(self, message: object = None) -> Any:
        start = time.perf_counter()
        self.message_bytes.append(len(pickle.dumps(message)))
        self.pickle_seconds += time.perf_counter() - start
        return super().__call__(message)


# -- the engines ----------------------------------------------------------------------------


@dataclass
class Probe:
    """Timers on one engine's hot path and the per-step figures they yield."""

    timers: dict[str, CallTimer]
    message_timer: MessageTimer | None
    schedules: list[dict[str, int]] = field(default_factory=list)
    per_step: dict[str, list[float]] = field(default_factory=dict)
    calls_per_step: dict[str, list[int]] = field(default_factory=dict)
    message_bytes: list[int] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.schedules.clear()
        self.per_step.clear()
        self.calls_per_step.clear()
        self.message_bytes.clear()
        for timer in self.timers.values():
            timer.tensor_sizes.clear()
        self.paths.clear()

    def timed_step(self, engine: Any) -> None:
        before = {name: (t.seconds, t.calls) for name, t in self.timers.items()}
        pickled_before = self.message_timer.pickle_seconds if self.message_timer else 0.0
        messages_before = len(self.message_timer.message_bytes) if self.message_timer else 0
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
        pickled = (self.message_timer.pickle_seconds if self.message_timer else 0.0) - pickled_before
        self.per_step.setdefault("step", []).append(step - pickled)
        for name, timer in self.timers.items():
            seconds, calls = before[name]
            spent = timer.seconds - seconds
            if name == "execute_model":
                spent -= pickled
            self.per_step.setdefault(name, []).append(spent)
            self.calls_per_step.setdefault(name, []).append(timer.calls - calls)
        if self.message_timer is not None:
            self.message_bytes += self.message_timer.message_bytes[messages_before:]


def install_probe(llm: Any) -> Probe:
    """Timers on the executor, the driver's runner call, the driver's collectives (TP>1)
    and the model's CPU decode paths (which one ran)."""
    executor = llm.engine.executor
    driver = executor.driver
    probe = Probe(timers={}, message_timer=None)
    outer = executor.execute_model

    def execute_model(scheduler_output: Any) -> Any:
        probe.schedules.append(dict(scheduler_output.num_scheduled_tokens))
        return outer(scheduler_output)

    probe.timers["execute_model"] = executor.execute_model = CallTimer(execute_model)
    probe.timers["driver_execute"] = driver.execute_model = CallTimer(driver.execute_model)
    tp = driver.tp
    if tp is not None:
        probe.timers["all_reduce"] = tp.all_reduce = CallTimer(tp.all_reduce)
        probe.timers["gather_vocab"] = tp.gather_vocab = CallTimer(tp.gather_vocab)
        probe.message_timer = tp.broadcast_from_driver = MessageTimer(tp.broadcast_from_driver)
        probe.timers["broadcast"] = probe.message_timer
    model = driver.model
    for name in ("fused_decode", "native_layers"):
        runner = getattr(model, name, None)
        if runner is not None:
            inner = runner.run

            def run(*args: Any, _inner: Callable[..., Any] = inner, _name: str = name, **kwargs: Any) -> Any:
                probe.paths[_name] = probe.paths.get(_name, 0) + 1
                return _inner(*args, **kwargs)

            runner.run = run
    return probe


def decode_path(probe: Probe, num_steps: int) -> str:
    """Which layer path the driver's decode steps took (steps counted per path)."""
    counted = sum(probe.paths.values())
    parts = [f"{name}" + (f" x{n}" if n != num_steps else "") for name, n in probe.paths.items()]
    if counted < num_steps:
        parts.append("torch" + (f" x{num_steps - counted}" if counted else ""))
    return "+".join(parts)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process, all its threads (None where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def synthetic_checkpoint(folder: Path, args: argparse.Namespace) -> Path:
    from pagellm.bench.synthetic_model import write_synthetic_checkpoint

    shape = {
        "vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 4096, "rope_theta": 100000.0, "tie_word_embeddings": True,
    }  # fmt: skip
    return write_synthetic_checkpoint(folder, shape=shape, with_weights=False)


def build_llms(model: str, args: argparse.Namespace, max_model_len: int, num_blocks: int) -> dict[int, Any]:
    from pagellm import LLM

    llms: dict[int, Any] = {}
    for tp in TP_SIZES:
        # The engine splits the threads it finds (TP=2's driver then sets its own share).
        torch.set_num_threads(args.threads)
        llms[tp] = LLM(
            model, tensor_parallel_size=tp, dtype=args.dtype, load_format=args.load_format, device="cpu",
            max_model_len=max_model_len, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False,
            max_num_seqs=max(args.batch_sizes), disable_log_stats=True, seed=0,
        )  # fmt: skip
    return llms


def threads_of(llm: Any, total: int) -> int:
    """CPU threads of the LLM's driver (TP>1: its share of `total`)."""
    threads = llm.engine.config.parallel_config.num_threads_per_rank
    return threads if threads is not None else total


def fill_decode_batch(llm: Any, prompts: list[list[int]], max_tokens: int, batch_size: int) -> list[str]:
    """Add the requests and step until the next step is a pure decode of all of them."""
    from pagellm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, prompt, params) for prompt in prompts]
    for _ in range(1000):
        scheduler = engine.scheduler
        running = scheduler.running
        if len(running) == batch_size and all(r.num_computed_tokens == r.num_tokens - 1 for r in running):
            return ids
        engine.step()
    raise RuntimeError("the requests did not all reach decode")


def run_engines(model: str, args: argparse.Namespace) -> dict[str, Any]:
    max_tokens = args.warmup + args.steps + 8
    max_model_len = args.prompt_len + max_tokens + 16
    blocks_per_request = -(-max_model_len // 16)
    num_blocks = max(args.batch_sizes) * blocks_per_request + 8
    build_start = time.perf_counter()
    llms = build_llms(model, args, max_model_len, num_blocks)
    build_s = time.perf_counter() - build_start
    try:
        threads = {tp: threads_of(llm, args.threads) for tp, llm in llms.items()}
        probes = {tp: install_probe(llm) for tp, llm in llms.items()}
        worker_pids = llms[2].engine.executor.worker_pids
        rng = random.Random(0)
        vocab = llms[1].engine.model_config.vocab_size
        rows: list[dict[str, Any]] = []
        rank1_idle_cpu = 0.0
        for batch_size in args.batch_sizes:
            prompts = [[rng.randrange(3, min(vocab, 256)) for _ in range(args.prompt_len)] for _ in range(batch_size)]
            ids = {}
            for tp, llm in llms.items():
                torch.set_num_threads(threads[tp])
                ids[tp] = fill_decode_batch(llm, prompts, max_tokens, batch_size)
                for _ in range(args.warmup):
                    llm.engine.step()
                probes[tp].reset()
            for tp, count in interleaved_blocks(args.steps, args.block_steps, list(llms)):
                torch.set_num_threads(threads[tp])
                cpu_before = process_cpu_seconds(worker_pids[0]) if tp == 1 else None
                for _ in range(count):
                    probes[tp].timed_step(llms[tp].engine)
                if cpu_before is not None:
                    rank1_idle_cpu += (process_cpu_seconds(worker_pids[0]) or 0.0) - cpu_before
            for tp, llm in llms.items():
                rows.append(step_row(tp, batch_size, threads[tp], probes[tp]))
                llm.engine.abort_request(ids[tp])
        return {"rows": rows, "build_s": round(build_s, 1), "rank1_cpu_s_while_tp1_stepped": round(rank1_idle_cpu, 3),
                "threads_per_rank": {str(tp): n for tp, n in threads.items()}}  # fmt: skip
    finally:
        for llm in llms.values():
            llm.shutdown()
        torch.set_num_threads(args.threads)


def step_row(tp: int, batch_size: int, threads: int, probe: Probe) -> dict[str, Any]:
    non_decode = sum(not is_pure_decode(s, batch_size) for s in probe.schedules)
    step = probe.per_step["step"]
    execute = probe.per_step["execute_model"]
    row: dict[str, Any] = {
        "tp": tp, "batch_size": batch_size, "threads_per_rank": threads, "steps": len(step),
        "non_decode_steps": non_decode, "decode_path": decode_path(probe, len(step)),
        "step_ms": summarize_ms(step),
        "tokens_per_s": round(batch_size / statistics.median(step), 1),
        "execute_model_ms_mean": round(statistics.fmean(execute) * 1e3, 3),
        "driver_execute_ms_mean": round(statistics.fmean(probe.per_step["driver_execute"]) * 1e3, 3),
        "engine_ms_mean": round(statistics.fmean(s - e for s, e in zip(step, execute, strict=True)) * 1e3, 3),
    }  # fmt: skip
    if "all_reduce" not in probe.per_step:
        return row
    comm = 0.0
    for name in ("broadcast", "all_reduce", "gather_vocab"):
        seconds = probe.per_step[name]
        calls = probe.calls_per_step[name]
        total_calls = sum(calls)
        mean = statistics.fmean(seconds)
        comm += mean
        timer = probe.timers[name]
        row[name] = {
            "ms_per_step_mean": round(mean * 1e3, 3),
            "ms_per_step_median": round(statistics.median(seconds) * 1e3, 3),
            "calls_per_step": round(total_calls / len(calls), 2),
            "us_per_call": round(sum(seconds) / total_calls * 1e6, 1) if total_calls else None,
            "tensors": [
                {"bytes": nbytes, "dtype": dtype, "shape": list(shape), "calls": n}
                for (nbytes, dtype, shape), n in sorted(timer.tensor_sizes.items())
            ],
        }  # fmt: skip
    sizes = probe.message_bytes
    row["broadcast"]["message_bytes"] = {"median": int(statistics.median(sizes)), "min": min(sizes), "max": max(sizes)}
    row["communication_ms_mean"] = round(comm * 1e3, 3)
    row["communication_share"] = round(comm / statistics.fmean(step), 3)
    # The driver's runner less its collectives: inputs, its model share, sampling.
    collectives = [a + g for a, g in zip(probe.per_step["all_reduce"], probe.per_step["gather_vocab"], strict=True)]
    rest = [d - c for d, c in zip(probe.per_step["driver_execute"], collectives, strict=True)]
    row["driver_compute_ms_mean"] = round(statistics.fmean(rest) * 1e3, 3)
    return row


# -- collectives alone ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collective_call(item: dict[str, Any], rank: int, world: int) -> Callable[[], object]:
    """One call of the planned collective, its buffers made once."""
    import torch.distributed as dist

    if item["op"] == "all_reduce":
        tensor = torch.ones(item["shape"], dtype=DTYPES[item["dtype"]])
        return lambda: dist.all_reduce(tensor)
    if item["op"] == "all_gather":
        part = torch.ones(item["shape"], dtype=DTYPES[item["dtype"]])
        parts = [torch.empty_like(part) for _ in range(world)]
        return lambda: dist.all_gather(parts, part)
    payload = b"x" * max(0, item["bytes"] - 40)  # pickles, in its list, to about `bytes`
    return lambda: dist.broadcast_object_list([payload if rank == 0 else None], src=0)


def _collective_rank(rank: int, world: int, init_method: str, plan: list[dict[str, Any]], queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    calls = [_collective_call(item, rank, world) for item in plan]
    for call, item in zip(calls, plan, strict=True):
        for _ in range(max(3, item["iters"] // 10)):
            call()
    dist.barrier()
    # Round-robin over the plan, a share of each item's calls per round, so that a busy
    # spell of the machine slows every size alike rather than one.
    results: list[list[float]] = [[] for _ in plan]
    for round_index in range(ROUNDS):
        for call, item, times in zip(calls, plan, results, strict=True):
            share = item["iters"] * (round_index + 1) // ROUNDS - item["iters"] * round_index // ROUNDS
            for _ in range(share):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def collectives_plan(
    all_reduce_shapes: list[tuple[list[int], str]],
    all_gather_shapes: list[tuple[list[int], str]],
    message_bytes: list[int],
    iters: int,
) -> list[dict[str, Any]]:
    """What the microbenchmark runs: each shape once, in the order given (big ones fewer times)."""
    plan: list[dict[str, Any]] = []

    def add(op: str, shape: list[int], dtype: str) -> None:
        nbytes = DTYPES[dtype].itemsize * int(torch.tensor(shape).prod())
        entry = {"op": op, "shape": shape, "dtype": dtype, "bytes": nbytes}
        if entry not in [{k: p[k] for k in entry} for p in plan]:
            plan.append({**entry, "iters": iters if nbytes <= 256 << 10 else max(10, iters // 10)})

    for shape, dtype in all_reduce_shapes:
        add("all_reduce", shape, dtype)
    for shape, dtype in all_gather_shapes:
        add("all_gather", shape, dtype)
    for nbytes in sorted(set(message_bytes)):
        plan.append({"op": "broadcast_object", "shape": [], "dtype": "", "bytes": nbytes, "iters": iters})
    return plan


def run_collectives(plan: list[dict[str, Any]], world: int = 2) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes = [
        context.Process(target=_collective_rank, args=(rank, world, init_method, plan, queue), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results = None
    while results is None:
        try:
            results = queue.get(timeout=1.0)
        except queue_module.Empty:
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if failed or all(p.exitcode is not None for p in processes):
                for p in processes:
                    p.kill()
                raise RuntimeError(f"a collectives rank exited with code {[p.exitcode for p in processes]}") from None
    for process in processes:
        process.join(timeout=30)
    rows = []
    for item, times in zip(plan, results, strict=True):
        median = statistics.median(times)
        row = {k: item[k] for k in ("op", "shape", "dtype", "bytes", "iters")}
        row["us_median"] = round(median * 1e6, 1)
        row["us_mean"] = round(statistics.fmean(times) * 1e6, 1)
        row["us_min"] = round(min(times) * 1e6, 1)
        if item["op"] == "all_reduce":
            row["bus_gb_s"] = round(all_reduce_bus_gbps(item["bytes"], median, world), 3)
        elif item["op"] == "all_gather":
            row["bus_gb_s"] = round(all_gather_bus_gbps(item["bytes"] * world, median, world), 3)
        else:
            row["bus_gb_s"] = round(item["bytes"] / median / 1e9, 3)
        rows.append(row)
    return rows


# -- report ---------------------------------------------------------------------------------


def comparison_rows(rows: list[dict[str, Any]], collectives: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size: TP=2 against TP=1, and how much of the driver's all-reduce time the
    same all-reduce alone accounts for (the rest is waiting for the other rank)."""
    out = []
    alone = {(tuple(c["shape"]), c["dtype"]): c["us_median"] for c in collectives if c["op"] == "all_reduce"}
    for batch_size in sorted({r["batch_size"] for r in rows}):
        by_tp = {r["tp"]: r for r in rows if r["batch_size"] == batch_size}
        if 1 not in by_tp or 2 not in by_tp:
            continue
        one, two = by_tp[1], by_tp[2]
        entry = {
            "batch_size": batch_size,
            "tp1_step_ms_median": one["step_ms"]["median"],
            "tp2_step_ms_median": two["step_ms"]["median"],
            "tp2_over_tp1": round(two["step_ms"]["median"] / one["step_ms"]["median"], 3),
            "tp2_minus_tp1_ms": round(two["step_ms"]["median"] - one["step_ms"]["median"], 3),
            "tp2_communication_ms_mean": two["communication_ms_mean"],
        }
        reduce = two["all_reduce"]
        tensors = reduce["tensors"]
        if tensors and reduce["us_per_call"]:
            main = max(tensors, key=lambda t: t["calls"])
            alone_us = alone.get((tuple(main["shape"]), main["dtype"]))
            if alone_us is not None:
                entry["all_reduce_us_per_call_in_step"] = reduce["us_per_call"]
                entry["all_reduce_bus_gb_s_in_step"] = round(
                    all_reduce_bus_gbps(main["bytes"], reduce["us_per_call"] / 1e6, 2), 3
                )
                entry["all_reduce_us_per_call_alone"] = alone_us
                entry["all_reduce_wait_ms_per_step_estimate"] = round(
                    (reduce["us_per_call"] - alone_us) * reduce["calls_per_step"] / 1e3, 3
                )
        out.append(entry)
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows),
    ]


def format_tables(record: dict[str, Any]) -> str:
    results = record["results"]
    lines: list[str] = []
    if results["steps"]:
        lines += ["Decode steps (ms per engine.step; engine = schedule/update/outputs around execute_model):", ""]
        lines += markdown_table(
            ["TP", "B", "threads/rank", "path", "median", "mean", "min", "tok/s", "execute mean", "engine mean"],
            [
                [r["tp"], r["batch_size"], r["threads_per_rank"], r["decode_path"], r["step_ms"]["median"],
                 r["step_ms"]["mean"], r["step_ms"]["min"], r["tokens_per_s"], r["execute_model_ms_mean"],
                 r["engine_ms_mean"]]
                for r in results["steps"]
            ],
        )  # fmt: skip
        lines += ["", "TP=2 driver per step: ms (calls, us per call); message = pickled StepMessage bytes:", ""]
        table = []
        for r in results["steps"]:
            if r["tp"] == 2:
                b, a, g = r["broadcast"], r["all_reduce"], r["gather_vocab"]
                main = max(a["tensors"], key=lambda t: t["calls"]) if a["tensors"] else None
                sizes = b["message_bytes"]
                table.append([
                    r["batch_size"], f"{b['ms_per_step_mean']} ({b['calls_per_step']:g}, {b['us_per_call']})",
                    f"{sizes['median']} ({sizes['min']}-{sizes['max']})",
                    f"{a['ms_per_step_mean']} ({a['calls_per_step']:g}, {a['us_per_call']})",
                    f"{main['shape']} {main['dtype']} ({main['bytes']} B)" if main else "-",
                    f"{g['ms_per_step_mean']} ({g['calls_per_step']:g}, {g['us_per_call']})",
                    f"{r['communication_share']:.1%}", r["driver_compute_ms_mean"],
                ])  # fmt: skip
        lines += markdown_table(
            ["B", "broadcast", "message bytes", "all_reduce", "all_reduce tensor", "gather_vocab", "comm share",
             "driver rest ms"],
            table,
        )  # fmt: skip
    if results["comparison"]:
        title = ("TP=2 against TP=1 (median steps; wait = the driver's all_reduce per call minus the same call "
                 "alone, x calls per step):")  # fmt: skip
        lines += ["", title, ""]
        lines += markdown_table(
            ["B", "TP=1 ms", "TP=2 ms", "TP=2 / TP=1", "difference ms", "TP=2 comm ms",
             "all_reduce us/call in step / alone", "bus GB/s in step", "wait ms/step (est.)"],
            [
                [c["batch_size"], c["tp1_step_ms_median"], c["tp2_step_ms_median"], c["tp2_over_tp1"],
                 f"{c['tp2_minus_tp1_ms']:+}", c["tp2_communication_ms_mean"],
                 f"{c.get('all_reduce_us_per_call_in_step', '-')} / {c.get('all_reduce_us_per_call_alone', '-')}",
                 c.get("all_reduce_bus_gb_s_in_step", "-"), c.get("all_reduce_wait_ms_per_step_estimate", "-")]
                for c in results["comparison"]
            ],
        )  # fmt: skip
    if results["collectives"]:
        lines += ["", "gloo collectives alone, 2 spawned processes, 1 thread each (loopback TCP):", ""]
        lines += markdown_table(
            ["op", "shape", "dtype", "bytes", "iters", "us median", "us mean", "us min", "bus GB/s"],
            [
                [c["op"], c["shape"], c["dtype"] or "-", c["bytes"], c["iters"], c["us_median"], c["us_mean"],
                 c["us_min"], c["bus_gb_s"]]
                for c in results["collectives"]
            ],
        )  # fmt: skip
    lines += ["", "Notes:", *(f"- {note}" for note in record["notes"])]
    return "\n".join(lines) + "\n"


def notes(record: dict[str, Any]) -> list[str]:
    config, results = record["config"], record["results"]
    cores = config["cpu_count"]
    out = [
        (f"TP=2 splits the same {config['threads']} threads ({cores} cores visible) between two processes: on the "
         "CPU it cannot be faster than TP=1 here; the figures measure its overhead."),
        ("A collective timed on the driver includes waiting for the other rank to reach it (load imbalance, "
         "scheduling noise); the collectives-alone table is the transfer itself."),
        "broadcast_from_driver returns on the driver once its send is done; the other rank unpickles after.",
    ]  # fmt: skip
    rows = results["steps"]
    if any(r["non_decode_steps"] for r in rows):
        out.append("WARNING: some timed steps were not pure decode steps of B rows (see non_decode_steps).")
    differing = [b for b in sorted({r["batch_size"] for r in rows})
                 if len({r["decode_path"] for r in rows if r["batch_size"] == b}) > 1]  # fmt: skip
    if differing:
        out.append(f"The driver's layer path differs between TP=1 and TP=2 at B={differing} (the one-call fused "
                   "decode layer runs only without tensor parallelism): that difference is in the step times too.")
    if "rank1_cpu_s_while_tp1_stepped" in results:
        out.append(f"TP=2's rank 1 used {results['rank1_cpu_s_while_tp1_stepped']} CPU seconds while TP=1 stepped "
                   "(idle, it should use ~0).")  # fmt: skip
    load = config["load_average_before"][0]
    if load > 0.5:
        out.append(f"The machine was busy before the run (1-minute load average {load} on {cores} cores): "
                   "expect noisy figures, rerun on an idle machine.")
    faster = [c["batch_size"] for c in results["comparison"] if c["tp2_over_tp1"] < 1]
    if faster:
        out.append(f"TP=2 beat TP=1 at B={faster}: a sign the cores were not free. A multi-threaded TP=1 waits at "
                   "every parallel region for its thread that another process holds; single-threaded ranks do not.")
    if config["load_format"] == "dummy":
        out.append("Weights are random (load_format dummy); every request runs to max_tokens (ignore_eos).")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="JSON file; the tables go beside it as .md (%(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.load_format is None:
        args.load_format = "auto" if args.model else "dummy"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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


if __name__ == "__main__":
    main()
