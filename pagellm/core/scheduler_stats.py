"""Core stage: the snapshot of scheduler counters and gauges the engine exports."""

from __future__ import annotations

import dataclasses


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
    num_tier_dropped_writes: int = 0
    num_tier_bytes_read: int = 0
    num_tier_bytes_written: int = 0
    tier_load_seconds: float = 0.0
    num_tier_load_batches: int = 0
    tier_bytes: int = 0
