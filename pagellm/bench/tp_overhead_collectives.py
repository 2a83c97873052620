"""Bench stage: gloo collectives alone, for benchmarks/tp_overhead.py: two spawned processes
time all_reduce, all_gather and broadcast_object_list at the sizes the engine's steps used,
and the bus bandwidth that each figure amounts to."""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

ROUNDS = 10  # rounds over all sizes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def all_reduce_bus_gbps(num_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce (nccl-tests' convention): a ring moves 2(n-1)/n of
    the buffer through every rank's link."""
    return 2 * (world_size - 1) / world_size * num_bytes / seconds / 1e9


def all_gather_bus_gbps(gathered_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an all-gather: every rank receives (n-1)/n of the gathered buffer."""
    return (world_size - 1) / world_size * gathered_bytes / seconds / 1e9


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
