"""Sim stage: data parallelism: M replicas of the engine, each with its own
scheduler and KV cache (and, with tensor parallelism, its own group of GPUs), serving
one workload together.

Routing is round-robin in arrival order: the i-th request to arrive goes to replica
i mod M. It ignores load and prefixes, so a run of long prompts landing on one replica
is not rebalanced and a shared prefix is prefilled on every replica (the server's
router, `pagellm serve --data-parallel-size`, follows prefix-cache affinity and load, so
it does at least as well on skewed or prefix-heavy workloads; the figures here are the
plain split's). It also keeps the replicas independent: each is simulated on its
own Simulator, and the results merge into one, as a client of the whole deployment sees
it: throughput over the longest replica's duration, latencies over every request.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core.scheduler_stats import SchedulerStats
from pagellm.errors import ConfigError
from pagellm.metrics.spec_decode_stats import SpecDecodeStats
from pagellm.sim.cost_model import StepCostModel
from pagellm.sim.speculation import SimSpeculationConfig
from pagellm.sim.request_stream import SimRequest
from pagellm.sim.simulator import KVSample, SimRequestResult, SimResult, Simulator, SimTier

ROUTING = "round-robin"


def split_round_robin(requests: Sequence[SimRequest], num_replicas: int) -> list[list[int]]:
    """Per replica, the indices of the requests it serves (ties in arrival time keep the
    workload's order, as the simulator admits them)."""
    if num_replicas < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {num_replicas}")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    for position, index in enumerate(order):
        shares[position % num_replicas].append(index)
    return shares


def run_replicas(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: StepCostModel,
    requests: Sequence[SimRequest],
    num_replicas: int,
    speculation: SimSpeculationConfig | None = None,
    tier: SimTier | None = None,
) -> SimResult:
    """Serve `requests` on `num_replicas` engines of the same configuration."""
    if num_replicas == 1:
        return Simulator(scheduler_config, cache_config, cost_model, speculation, tier).run(requests)
    shares = split_round_robin(requests, num_replicas)
    results = [
        Simulator(scheduler_config, cache_config, cost_model, _replica_speculation(speculation, index), tier).run(
            [requests[i] for i in share]
        )
        for index, share in enumerate(shares)
    ]
    return merge_results(results, shares, len(requests))


def _replica_speculation(speculation: SimSpeculationConfig | None, index: int) -> SimSpeculationConfig | None:
    """Each replica draws its acceptances from its own seed (the same draws on every
    replica would correlate them)."""
    if speculation is None or index == 0:
        return speculation
    return dataclasses.replace(speculation, seed=speculation.seed + index)


def merge_results(
    results: Sequence[SimResult], shares: Sequence[Sequence[int]], num_requests: int
) -> SimResult:
    """One SimResult for the whole deployment.

    Per request: as its replica served it, back at its index in the workload. Time: the
    deployment is done when its last replica is; busy_s is the replicas' mean (so
    busy / duration stays the share of time the GPUs work). The KV cache is all the
    replicas' caches together: usage is the mean over replicas (their capacities are
    equal), token counts and queue lengths are sums.
    """
    assert len(results) == len(shares) and results
    merged: list[SimRequestResult | None] = [None] * num_requests
    itl = array("d")
    for result, share in zip(results, shares):
        for index, request in zip(share, result.requests):
            merged[index] = request
        itl.extend(result.itl_s)
    assert all(request is not None for request in merged)
    samples, interval = merge_kv_samples(results)
    first = results[0]
    cache = first.cache_config
    total_cache = dataclasses.replace(
        cache,
        num_gpu_blocks=len(results) * cache.num_usable_gpu_blocks + 1,  # one null block
        num_cpu_blocks=len(results) * cache.num_cpu_blocks,
    )
    return SimResult(
        requests=merged,  # type: ignore[arg-type]
        itl_s=itl,
        kv_samples=samples,
        kv_sample_interval_s=interval,
        stats=merge_stats([r.stats for r in results]),
        num_steps=sum(r.num_steps for r in results),
        busy_s=sum(r.busy_s for r in results) / len(results),
        duration_s=max(r.duration_s for r in results),
        num_extrapolated_steps=sum(r.num_extrapolated_steps for r in results),
        wall_s=sum(r.wall_s for r in results),
        scheduler_config=first.scheduler_config,
        cache_config=total_cache,
        cost_model=first.cost_model,
        speculation=first.speculation,
        spec_decode=(
            None if first.spec_decode is None
            else sum((r.spec_decode for r in results if r.spec_decode is not None), SpecDecodeStats())
        ),
    )


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """Counters and queue lengths add up; usage fractions average (equal capacities)."""
    values = {}
    for field in dataclasses.fields(SchedulerStats):
        items = [getattr(s, field.name) for s in stats]
        # The annotation, not the value: a usage of exactly 0 may be an int.
        if field.type in ("float", float):
            values[field.name] = sum(items) / len(items)
        elif isinstance(items[0], dict):  # counts by name (requests per LoRA adapter)
            merged: dict = {}
            for counts in items:
                for name, count in counts.items():
                    merged[name] = merged.get(name, 0) + count
            values[field.name] = merged
        else:
            values[field.name] = sum(items)
    return SchedulerStats(**values)


def merge_kv_samples(results: Sequence[SimResult]) -> tuple[list[KVSample], float]:
    """The replicas' KV samples on one time grid, the coarsest replica's.

    Every replica samples at each multiple of its interval from 0 on, and intervals only
    ever double from the same first one, so sample k of the coarsest grid is sample
    k * stride of a finer replica. A replica whose run ended is idle and empty from
    then on (its simulation stops once it has served its share).
    """
    interval = max(r.kv_sample_interval_s for r in results)
    strides = [round(interval / r.kv_sample_interval_s) for r in results]
    length = max(-(-len(r.kv_samples) // stride) for r, stride in zip(results, strides))
    merged = []
    for k in range(length):
        present = [
            r.kv_samples[k * stride]
            for r, stride in zip(results, strides)
            if k * stride < len(r.kv_samples)
        ]
        merged.append(KVSample(
            time_s=k * interval,
            usage=sum(s.usage for s in present) / len(results),
            num_running=sum(s.num_running for s in present),
            num_waiting=sum(s.num_waiting for s in present),
            logical_tokens=sum(s.logical_tokens for s in present),
            paged_tokens=sum(s.paged_tokens for s in present),
            contiguous_tokens=sum(s.contiguous_tokens for s in present),
        ))  # fmt: skip
    return merged, interval
