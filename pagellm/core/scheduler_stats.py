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
