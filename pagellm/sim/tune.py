"""Sim stage: `pagellm tune`'s search: a grid of engine arguments, simulated and ranked.

Two goals:
- throughput: the highest output tok/s among configurations that meet the latency
  limits (p99 TTFT, p99 ITL) and serve every request;
- latency: the lowest value of one latency statistic (p99 TTFT by default) at the
  workload's request rate, among configurations that serve every request.
A configuration the engine would refuse to start (the KV cache cannot hold one request
of max_model_len, or no memory is left for it) is listed as invalid with the reason.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagellm.config.engine_args import EngineArgs
from pagellm.errors import ConfigError

logger = logging.getLogger(__name__)

GOALS = ("throughput", "latency")
LATENCY_METRICS = tuple(
    f"{metric}_{stat}" for metric in ("ttft", "itl", "tpot", "e2el") for stat in ("median", "p90", "p99")
)
# The knobs tune sweeps when given no values: the two that trade throughput against
# latency most directly. The others stay at EngineArgs' defaults unless listed.
# Relative difference in output tok/s below which two configurations count as equal.
THROUGHPUT_TIE = 0.01
DEFAULT_GRID: dict[str, tuple[Any, ...]] = {
    "max_num_seqs": (64, 128, 256, 512),
    "max_num_batched_tokens": (1024, 2048, 4096, 8192),
}


@dataclass(frozen=True)
class TuneGoal:
    goal: str = "throughput"
    max_p99_ttft_ms: float | None = None
    max_p99_itl_ms: float | None = None
    latency_metric: str = "ttft_p99"

    def __post_init__(self) -> None:
        if self.goal not in GOALS:
            raise ConfigError(f"--goal must be one of {GOALS}, got {self.goal!r}")
        if self.latency_metric not in LATENCY_METRICS:
            raise ConfigError(
                f"--latency-metric must be one of {', '.join(LATENCY_METRICS)}, got {self.latency_metric!r}"
            )
        for name in ("max_p99_ttft_ms", "max_p99_itl_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")

    @property
    def has_limits(self) -> bool:
        return self.max_p99_ttft_ms is not None or self.max_p99_itl_ms is not None

    def latency_of(self, summary: dict[str, Any]) -> float:
        metric, stat = self.latency_metric.split("_")
        value = summary.get(f"{metric}_ms_{stat}")
        return math.inf if value is None else float(value)


@dataclass(frozen=True)
class TunePoint:
    """One configuration of the grid and what its simulation showed."""

    knobs: dict[str, Any]  # the swept values
    summary: dict[str, Any] | None  # None: the configuration is invalid
    engine: dict[str, Any] = field(default_factory=dict)  # the resolved engine settings
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.summary is not None


def grid_points(values: dict[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the knobs' values, in a stable order."""
    names = list(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*(values[n] for n in names))]


def violations(point: TunePoint, goal: TuneGoal) -> list[str]:
    """Why the point misses the goal's requirements (empty: it meets them)."""
    if point.summary is None:
        return [point.error or "invalid"]
    s = point.summary
    missed = []
    if s["completed"] < s["num_requests"]:
        missed.append(f"{s['num_requests'] - s['completed']} requests refused")
    ttft, itl = s.get("ttft_ms_p99"), s.get("itl_ms_p99")
    if goal.max_p99_ttft_ms is not None and (ttft is None or ttft > goal.max_p99_ttft_ms):
        missed.append(f"p99 TTFT {ttft} ms > {goal.max_p99_ttft_ms:g}")
    if goal.max_p99_itl_ms is not None and (itl is None or itl > goal.max_p99_itl_ms):
        missed.append(f"p99 ITL {itl} ms > {goal.max_p99_itl_ms:g}")
    return missed


def slo_attainment(requests: Sequence[Any], goal: TuneGoal) -> float | None:
    """The share of requests that meet the latency limits on their own (vLLM's goodput
    rule): TTFT within --max-p99-ttft-ms and TPOT (the request's mean time per output
    token after the first) within --max-p99-itl-ms. A refused request misses. None when
    the goal sets no limits.

    `requests` are SimRequestResults. This is per request, while the goal's limits are on
    the p99 over all requests (and over all token gaps): a configuration can meet its p99
    limits at 99% attainment, or miss them at 98%.
    """
    if not goal.has_limits or not requests:
        return None
    met = 0
    for r in requests:
        if r.first_token_s is None or r.finish_s is None:
            continue
        if goal.max_p99_ttft_ms is not None and (r.first_token_s - r.arrival_s) * 1e3 > goal.max_p99_ttft_ms:
            continue
        if goal.max_p99_itl_ms is not None and r.num_output_tokens > 1:
            tpot_ms = (r.finish_s - r.first_token_s) * 1e3 / (r.num_output_tokens - 1)
            if tpot_ms > goal.max_p99_itl_ms:
                continue
        met += 1
    return round(met / len(requests), 4)


def rank(points: Sequence[TunePoint], goal: TuneGoal) -> list[TunePoint]:
    """Best first: points meeting the requirements, by the goal; then the rest, by how
    close they come (fewer misses, then the same order); invalid points last.

    For the throughput goal, points within THROUGHPUT_TIE of the best throughput count
    as tied (when every configuration keeps up with the offered load, the differences
    are rounding) and go to the lowest latency among them.
    """
    meeting = [p for p in points if p.summary is not None and not violations(p, goal)]
    best = max((p.summary["output_tok_s"] or 0.0 for p in meeting), default=0.0)  # type: ignore[index]

    def key(point: TunePoint) -> tuple[Any, ...]:
        if point.summary is None:
            return (2, 0, 0, 0.0, 0.0)
        missed = len(violations(point, goal))
        throughput = point.summary.get("output_tok_s") or 0.0
        latency = goal.latency_of(point.summary)
        if goal.goal == "latency":
            return (int(missed > 0), missed, 0, latency, -throughput)
        tied = not missed and throughput >= best * (1 - THROUGHPUT_TIE)
        if tied:
            return (0, 0, 0, latency, -throughput)
        return (int(missed > 0), missed, 1, -throughput, latency)

    return sorted(points, key=key)


def run_grid(
    points: Sequence[dict[str, Any]],
    simulate_point: Callable[[dict[str, Any]], TunePoint],
    jobs: int = 1,
    on_point_done: Callable[[], object] | None = None,
) -> list[TunePoint]:
    """Simulate every point, on `jobs` processes; on_point_done is called once per finished
    point (a progress bar). Results keep the order of `points`.

    The processes are spawned, not forked, and given `simulate_point` (picklable) once
    each: a child forked from a process with other threads (a server's, a test runner's)
    can inherit a lock that one of them held, and then waits on it forever; this hung the
    test suite (two children blocked allocating their first block pool)."""
    if jobs <= 1 or len(points) <= 1:
        results = []
        for point in points:
            results.append(simulate_point(point))
            if on_point_done is not None:
                on_point_done()
        return results
    import multiprocessing

    found: dict[int, TunePoint] = {}
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(jobs, len(points)), initializer=_set_point_function, initargs=(simulate_point,)) as pool:
        # Unordered, so that progress counts points as they finish, not in grid order.
        for index, result in pool.imap_unordered(_simulate_in_child, enumerate(points), chunksize=1):
            found[index] = result
            if on_point_done is not None:
                on_point_done()
    return [found[i] for i in range(len(points))]


_POINT_FUNCTION: Callable[[dict[str, Any]], TunePoint] | None = None  # a worker process's


def _set_point_function(simulate_point: Callable[[dict[str, Any]], TunePoint]) -> None:
    global _POINT_FUNCTION
    _POINT_FUNCTION = simulate_point


def _simulate_in_child(item: tuple[int, dict[str, Any]]) -> tuple[int, TunePoint]:
    assert _POINT_FUNCTION is not None
    index, point = item
    return index, _POINT_FUNCTION(point)


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)


def command_line(model: str, engine: dict[str, Any]) -> str:
    """The recommended configuration as a ready `pagellm serve` command (data parallelism
    is simulated with arrivals split round-robin; the server's router also follows
    prefix-cache affinity, which only helps)."""
    parts = ["pagellm serve", f"--model {model}"]
    for name in ("data_parallel_size", "tensor_parallel_size",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                 "gpu_memory_utilization", "max_num_partial_prefills", "long_prefill_token_threshold",
                 "prefill_share", "scheduling_policy"):  # fmt: skip
        if name in engine:
            parts.append(f"--{name.replace('_', '-')} {engine[name]}")
    if engine.get("enable_chunked_prefill") is False:
        parts.append("--no-enable-chunked-prefill")
    if engine.get("enable_prefix_caching") is False:
        parts.append("--no-enable-prefix-caching")
    if engine.get("preemption_mode", "recompute") != "recompute":
        parts.append(f"--preemption-mode {engine['preemption_mode']}")
    if engine.get("kv_offload_bytes"):  # the disk tier: a folder of the user's choice
        parts.append(f"--kv-offload-path DIR --kv-offload-bytes {engine['kv_offload_bytes']}")
    return " ".join(parts)


def simulated_tier(tier_bytes: int | None) -> dict[str, Any]:
    """EngineArgs' fields of a simulated prefix-cache tier of `tier_bytes` (0 or None:
    none); its directory is never touched."""
    if tier_bytes is not None and tier_bytes < 0:
        raise ConfigError(f"--kv-offload-bytes must be >= 0 (0: no tier), got {tier_bytes}")
    if not tier_bytes:
        return {"kv_offload_path": None}
    return {"kv_offload_bytes": tier_bytes, "kv_offload_path": "(simulated)"}


def engine_args_for(base: EngineArgs, knobs: dict[str, Any]) -> EngineArgs:
    import dataclasses

    knobs = dict(knobs)
    if "kv_offload_bytes" in knobs:  # a swept tier size: the tier's two fields
        knobs.update(simulated_tier(knobs.pop("kv_offload_bytes")))
    return dataclasses.replace(base, **knobs)
