"""Metrics stage: the JSON picture of the engine that the dashboard draws.

Built on demand (only when someone watches), from the scheduler's queues, the KV cache
manager's block tables and the metrics' time series. The engine hands itself in as a
`DashboardSource` (the few things read here); metrics never import the engine.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagellm.core.scheduler import Scheduler
    from pagellm.metrics.engine_metrics import EngineMetrics


class DashboardSource(Protocol):
    """What the dashboard reads from an engine (LLMEngine satisfies it)."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def metrics(self) -> EngineMetrics: ...

    @property
    def num_steps(self) -> int: ...

    @property
    def model_name(self) -> str: ...

# Block states in `blocks.state` (owners are in `blocks.owner`).
FREE, CACHED_FREE, NULL, OWNED, SHARED = 0, 1, 2, 3, 4


def dashboard_state(engine: DashboardSource, max_series_points: int = 300) -> dict[str, Any]:
    scheduler = engine.scheduler
    manager = scheduler.kv_cache_manager
    pool = manager.device_pool
    requests = []
    index_of: dict[str, int] = {}
    for status, queue in (("running", scheduler.running), ("swapped", scheduler.swapped), ("waiting", scheduler.waiting)):
        for request in queue:
            index_of[request.request_id] = len(requests)
            requests.append(
                {
                    "id": request.request_id,
                    "status": status,
                    "prompt_tokens": request.num_prompt_tokens,
                    "output_tokens": request.num_output_tokens,
                    "computed_tokens": request.num_computed_tokens,
                    "device_blocks": manager.num_blocks_held(request.request_id),
                    "host_blocks": len(manager.get_host_block_ids(request.request_id)),
                    "adapter": None if request.lora_request is None else request.lora_request.lora_name,
                }
            )
    num_blocks = pool.num_blocks  # blocks never used are not made: FREE
    state = [FREE] * num_blocks
    owner = [-1] * num_blocks
    for block in pool.blocks:
        if block is pool.null_block:
            state[block.block_id] = NULL
        elif block.ref_cnt == 0 and block.block_hash is not None:
            state[block.block_id] = CACHED_FREE
        elif block.ref_cnt > 1:
            state[block.block_id] = SHARED
        elif block.ref_cnt == 1:
            state[block.block_id] = OWNED
    for request_id in manager.request_ids_holding_blocks():
        for table in manager.get_block_tables(request_id):  # every KV cache group's
            for block_id in table:
                if block_id != pool.null_block.block_id and owner[block_id] == -1:
                    owner[block_id] = index_of.get(request_id, -1)
    stats = scheduler.make_stats()
    metrics = engine.metrics
    series = list(metrics.series)[-max_series_points:]
    utilization = None
    if metrics.last_utilization is not None and metrics.ceilings is not None:
        used = metrics.last_utilization
        utilization = {
            "mfu": used.mfu,
            "mbu": used.mbu,
            "summary": used.describe(),
            "hint": used.hint(stats.num_running, stats.num_waiting, metrics.max_num_seqs),
            "flops_ceiling": metrics.ceilings.flops_per_s,
            "bandwidth_ceiling": metrics.ceilings.bytes_per_s,
            "source": metrics.ceilings.source,
        }
    return {
        "time": time.time(),
        "model": engine.model_name,
        "step": engine.num_steps,
        "block_size": manager.block_size,
        "blocks": {"state": state, "owner": owner},
        "host_blocks": {"total": manager.host_pool.num_blocks, "usage": stats.host_kv_cache_usage},
        "requests": requests,
        "queues": {"running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped},
        "kv_usage": stats.kv_cache_usage,
        "counters": {
            "preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap,
            "allocation_failures": stats.num_allocation_failures,
            "prefix_hit_tokens": stats.num_prefix_hit_tokens,
            "prefix_query_tokens": stats.num_prefix_query_tokens,
            "prefill_tokens": stats.num_prefill_tokens,
            "decode_tokens": stats.num_decode_tokens,
        },
        "series": series,
        "utilization": utilization,
        # Totals since start; None where nothing was verified (no speculation configured,
        # or no step small enough to speculate).
        "spec_decode": dataclasses.asdict(metrics.spec_decode) if metrics.spec_decode.num_verifications else None,
    }
