"""Core stage: what the KV cache manager hands out: a prefix hit at admission
(ComputedBlocks) and its cumulative counters (KVCacheStats)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class ComputedBlocks(NamedTuple):
    """Prefix-cache hit of a request about to be admitted."""

    blocks: list[list[int]]  # per KV cache group, the cached device blocks in table order ([]: no hit)
    num_computed_tokens: int  # tokens whose KV those blocks already hold
    # The second tier: digests of the blocks after the device hit found there (to load),
    # and of the blocks looked up after them that neither tier holds (misses); or, when
    # the cost rule says computing beats loading, how many were found but not taken.
    tier_digests: tuple[bytes, ...] = ()
    num_tier_misses: int = 0
    num_tier_skipped: int = 0
    # A hybrid model: the snapshot of the recurrent state after the hit's last block (tier
    # loads included), kept on the device (a slot) or in the tier (its key).
    snapshot_slot: int | None = None
    state_key: bytes | None = None


NO_HIT = ComputedBlocks([], 0)


@dataclasses.dataclass
class KVCacheStats:
    """Cumulative counters since the manager was created."""

    num_prefix_query_tokens: int = 0  # tokens of admitted requests looked up
    num_prefix_hit_tokens: int = 0  # of those, tokens found in the cache
    num_allocation_attempts: int = 0
    num_allocation_failures: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_window_freed_blocks: int = 0  # blocks sliding groups let go of while their requests ran


__all__ = ["NO_HIT", "ComputedBlocks", "KVCacheStats"]
