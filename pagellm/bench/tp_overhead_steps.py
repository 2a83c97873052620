"""Bench stage: the decode steps of benchmarks/tp_overhead.py: TP=1 and TP=2 engines stepped
in alternating blocks, timers on the driver's hot path and collectives, and one row of
figures per TP degree and batch size (pagellm/bench/tp_overhead.py says how)."""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TP_SIZES = (1, 2)


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
    paths = driver.runner.step_paths
    for name, path_name, attribute in (("fused_decode", "fused", "fused"), ("native_layers", "layers", "layer_ops")):
        runner = getattr(paths.get(path_name), attribute, None)
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
