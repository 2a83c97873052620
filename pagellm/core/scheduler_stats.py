"""Core stage: the snapshot of scheduler counters and gauges the engine exports."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.request import Request


@dataclasses.dataclass(frozen=True)
class FinishedRequestStats:
    """What one finished request (one completion of an n > 1 request) went through."""

    request_id: str  # the request's own id (a completion's parent's)
    num_preemptions: int
    num_tier_tokens: int  # prompt tokens loaded from the prefix cache's tier when first admitted


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot: queue sizes and usage now, counters cumulative since start."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    num_free_blocks: int  # device blocks free (cached-free included)
    host_kv_cache_usage: float
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_allocation_attempts: int
    num_allocation_failures: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped_in_blocks: int
    num_swapped_out_blocks: int
    num_prefill_tokens: int  # prompt tokens computed (recomputation included)
    num_decode_tokens: int  # output tokens fed back and computed
    # LoRA: requests per adapter name, running and waiting (swapped ones count as waiting);
    # empty without adapters.
    running_by_adapter: dict[str, int] = dataclasses.field(default_factory=dict)
    waiting_by_adapter: dict[str, int] = dataclasses.field(default_factory=dict)
    # The prefix cache's second tier (core/kv_tier.py; all 0 without one): blocks found
    # there after a device miss (loaded), looked up and found nowhere, found but computed
    # (cost rule), loads that failed their checks, writes done and dropped (queue full),
    # bytes moved, the summed wall time of load batches, and the bytes it holds now.
    num_tier_hit_blocks: int = 0
    num_tier_miss_blocks: int = 0
    num_tier_skipped_blocks: int = 0
    num_tier_failed_loads: int = 0
    num_tier_written_blocks: int = 0
    num_tier_written_states: int = 0  # a hybrid model's snapshots (core/kv_tier_access.py)
    num_tier_loaded_states: int = 0
    num_tier_dropped_writes: int = 0
    num_tier_bytes_read: int = 0
    num_tier_bytes_written: int = 0
    tier_load_seconds: float = 0.0
    num_tier_load_batches: int = 0
    tier_bytes: int = 0


def kv_cache_fields(kv: KVCacheManager) -> dict[str, Any]:
    """SchedulerStats' fields that the KV cache manager (and its tier) knows."""
    stats = kv.make_stats()
    fields: dict[str, Any] = {
        "kv_cache_usage": kv.get_usage(),
        "num_free_blocks": kv.num_free_blocks,
        "host_kv_cache_usage": kv.get_host_usage(),
        "num_prefix_query_tokens": stats.num_prefix_query_tokens,
        "num_prefix_hit_tokens": stats.num_prefix_hit_tokens,
        "num_allocation_attempts": stats.num_allocation_attempts,
        "num_allocation_failures": stats.num_allocation_failures,
        "num_swapped_in_blocks": stats.num_swapped_in_blocks,
        "num_swapped_out_blocks": stats.num_swapped_out_blocks,
    }
    if kv.tier is not None:
        tier = kv.tier.stats
        fields.update(
            num_tier_hit_blocks=tier.num_hit_blocks,
            num_tier_miss_blocks=tier.num_miss_blocks,
            num_tier_skipped_blocks=tier.num_skipped_blocks,
            num_tier_failed_loads=tier.num_failed_loads,
            num_tier_written_blocks=tier.num_written_blocks,
            num_tier_written_states=tier.num_written_states,
            num_tier_loaded_states=tier.num_loaded_states,
            num_tier_dropped_writes=tier.num_dropped_writes,
            num_tier_bytes_read=tier.bytes_read,
            num_tier_bytes_written=tier.bytes_written,
            tier_load_seconds=tier.load_seconds,
            num_tier_load_batches=tier.num_load_batches,
            tier_bytes=kv.tier.num_bytes,
        )
    return fields


def by_adapter(requests: Iterable[Request]) -> dict[str, int]:
    """How many of the requests run under each LoRA adapter (by name)."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
