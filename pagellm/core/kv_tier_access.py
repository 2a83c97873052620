"""Core stage: the prefix cache's second tier (core/kv_tier.py) seen from the KV cache
manager: what a lookup finds there, what an admission loads, what is written.

A model whose layers all attend continues a device hit with the run of blocks the tier
holds after it. A hybrid model (linear-attention layers) can only resume where it has
the recurrent state after the hit: so its lookup takes the furthest snapshot boundary up
to which the KV is on the device or in the tier and whose snapshot is kept on the device
or in the tier, and loads the blocks after the device hit up to there and, when the
snapshot comes from the tier, the state into the request's slot. Snapshots are written
to the tier once the step that took them is done, like blocks once they are cached.

A mixin of KVCacheManager (core/kv_cache_manager.py), which owns the pools and tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pagellm.core.block_pool import NULL_BLOCK_ID
from pagellm.core.kv_tier import TierCostModel, TierIndex, block_digest, group_key, state_key
from pagellm.request import BlockHash, Request

if TYPE_CHECKING:
    from pagellm.core.block_pool import BlockPool
    from pagellm.core.kv_cache_records import ComputedBlocks, KVCacheStats
    from pagellm.core.kv_events import KVEventLog
    from pagellm.core.state_slots import StateSlots
    from pagellm.core.state_snapshots import StateSnapshots


class TierLookup(NamedTuple):
    """What the tier adds to a device hit: blocks to load after it (in table order), the
    blocks looked up after those that it lacks, how many found were not taken (the cost
    rule), and for a hybrid where it resumes: the hit's length in blocks, the snapshot
    to restore (a device slot) or to load (a tier key)."""

    digests: tuple[bytes, ...] = ()
    num_misses: int = 0
    num_skipped: int = 0
    num_hit_blocks: int = 0
    snapshot_slot: int | None = None
    state_key: bytes | None = None


class TierLoad(NamedTuple):
    """A request admitted to load its prefix from the tier in the step being scheduled."""

    block_digests: list[bytes]  # in table order, after its device hit
    state_key: bytes | None = None  # a hybrid's snapshot, loaded into its state slot


class KVTierAccess:
    """The tier's part of KVCacheManager (declared here for readers)."""

    block_size: int
    num_groups: int
    device_pool: BlockPool
    events: KVEventLog | None
    stats: KVCacheStats
    tier: TierIndex | None
    tier_cost: TierCostModel
    _block_tables: dict[str, list[list[int]]]
    _num_cached_blocks: dict[str, int]
    state_slots: StateSlots
    snapshots: StateSnapshots
    _pending_restores: list[tuple[int, int]]
    _pending_offloads: list[tuple[bytes, int]]
    _pending_state_offloads: list[tuple[bytes, int]]
    _pending_state_loads: list[tuple[bytes, int]]
    _adapter_snapshots: set[BlockHash]

    # ----------------------------------------------------------------- lookups

    def group_keys(self, digest: bytes) -> list[bytes]:
        """The tier keys of a block's entries, one per KV cache group."""
        return [group_key(digest, group) for group in range(self.num_groups)]

    def _tier_run(self, hashes: list[BlockHash], start: int, end: int) -> list[bytes]:
        """The digests of the blocks start, start + 1, ... before `end` that the tier holds
        (every group's entry, written or being written), up to its first miss."""
        assert self.tier is not None
        digests: list[bytes] = []
        for index in range(start, end):
            digest = block_digest(hashes[index])
            if not all(self.tier.holds(key) for key in self.group_keys(digest)):
                break
            digests.append(digest)
        return digests

    def _entries_bytes(self, digests: tuple[bytes, ...] | list[bytes]) -> int:
        assert self.tier is not None
        return sum(self.tier.entry_bytes(key) for digest in digests for key in self.group_keys(digest))

    def _tier_lookup(self, request: Request, hashes: list[BlockHash], num_hit: int, max_hit_blocks: int) -> TierLookup:
        """The run of blocks after the device hit that the tier holds, to load unless the
        cost rule says computing them is faster."""
        if self.tier is None or request.lora_request is not None or num_hit >= max_hit_blocks:
            return TierLookup(num_hit_blocks=num_hit)
        digests = self._tier_run(hashes, num_hit, max_hit_blocks)
        num_misses = max_hit_blocks - num_hit - len(digests)
        num_bytes = self._entries_bytes(digests)
        if digests and not self.tier_cost.loading_pays(num_bytes, len(digests) * self.block_size):
            return TierLookup((), num_misses, len(digests), num_hit)
        return TierLookup(tuple(digests), num_misses, 0, num_hit)

    def _hybrid_tier_lookup(
        self, request: Request, hashes: list[BlockHash], device_hit: int, device_resume: int, max_hit_blocks: int
    ) -> TierLookup | None:
        """A hybrid's resume point past `device_resume` (its last device snapshot within
        the device hit of `device_hit` blocks) that the tier makes possible, or None."""
        if self.tier is None or request.lora_request is not None:
            return None
        digests = self._tier_run(hashes, device_hit, max_hit_blocks) if device_hit < max_hit_blocks else []
        num_misses = max(0, max_hit_blocks - device_hit - len(digests))
        interval = self.snapshots.interval_blocks
        # Snapshots are only taken after multiples of the interval.
        for end in range((device_hit + len(digests)) // interval * interval, device_resume, -interval):
            block_hash = hashes[end - 1]
            slot = self.snapshots.slot_of(block_hash)
            key = None if slot is not None else state_key(block_digest(block_hash))
            if key is not None and key not in self.tier:
                continue
            loads = tuple(digests[: max(0, end - device_hit)])
            num_bytes = self._entries_bytes(loads)
            num_bytes += self.tier.entry_bytes(key) if key is not None else 0
            if not self.tier_cost.loading_pays(num_bytes, (end - device_resume) * self.block_size):
                return TierLookup((), num_misses, len(loads) + (key is not None), 0)
            return TierLookup(loads, num_misses, 0, min(end, device_hit), slot, key)
        return TierLookup((), num_misses) if num_misses else None

    # -------------------------------------------------------------- admission

    def allocate_for_load(self, request: Request, computed: ComputedBlocks) -> TierLoad | None:
        """Admit a request whose prefix continues in the tier: take its device hit, fresh
        blocks for the tier's part (every block in a global group; in a sliding group those
        its window reads after the loaded run, NULL_BLOCK_ID before them) and (a hybrid) a
        state slot, restored from a device snapshot or loaded. Returns what the step loads
        (the block loads are queued for take_pending_loads), or None when the pool lacks
        room (nothing changed). No slots for new tokens: the request computes from the next
        step on, once the loads are verified."""
        assert self.tier is not None and (computed.tier_digests or computed.state_key is not None)
        request_id = request.request_id
        assert request_id not in self._block_tables, "request already holds blocks"
        pool = self.device_pool
        hit_tables = computed.blocks or [[] for _ in range(self.num_groups)]
        num_load = len(computed.tier_digests)
        start = len(hit_tables[0])
        end = start + num_load
        # Per group, the blocks its window has passed at the loaded run's end: device-hit
        # blocks among them (read at the hit's end) are not taken, loaded ones not loaded.
        passed = [self.num_passed_blocks(group, end * self.block_size) for group in range(self.num_groups)]
        skipped = [min(start, num) for num in passed]
        hit_tables = [[NULL_BLOCK_ID] * n + table[n:] for table, n in zip(hit_tables, skipped, strict=True)]
        hit_blocks = [pool.blocks[i] for table in hit_tables for i in table if i != NULL_BLOCK_ID]
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        # Per group, the first loaded index its window still reads at the run's end.
        first_read = [max(start, num) for num in passed]
        num_new = sum(end - first for first in first_read)
        self.stats.num_allocation_attempts += 1
        if num_new + num_free_hits > pool.num_free_blocks or (self.state_slots.enabled and not self.state_slots.num_free):
            self.stats.num_allocation_failures += 1
            return None
        pool.touch(hit_blocks)
        load_ids = [
            [NULL_BLOCK_ID] * (first - start) + [block.block_id for block in pool.allocate(end - first)] for first in first_read
        ]
        self._block_tables[request_id] = [list(table) + ids for table, ids in zip(hit_tables, load_ids, strict=True)]
        self._num_cached_blocks[request_id] = start
        if self.state_slots.enabled:
            slot = self.state_slots.allocate(request_id)
            if computed.state_key is not None:
                self._pending_state_loads.append((computed.state_key, slot))
            else:
                assert computed.snapshot_slot is not None, "a hybrid resumes from a snapshot"
                self._pending_restores.append((computed.snapshot_slot, slot))
        block_keys = [key for digest in computed.tier_digests for key in self.group_keys(digest)]
        loaded_keys = [*block_keys, *([computed.state_key] if computed.state_key is not None else [])]
        self.tier.touch(loaded_keys)
        tier_stats = self.tier.stats
        tier_stats.num_hit_blocks += num_load
        tier_stats.num_miss_blocks += computed.num_tier_misses
        self.stats.num_prefix_query_tokens += request.num_tokens
        self.stats.num_prefix_hit_tokens += computed.num_computed_tokens
        if self.events is not None:
            if hit_blocks:
                self.events.record("cache_hit", request_id, [block.block_id for block in hit_blocks])
            if num_new:
                self.events.record("allocate", request_id, [i for ids in load_ids for i in ids if i != NULL_BLOCK_ID])
        for group, ids in enumerate(load_ids):
            keys = [group_key(digest, group) for digest in computed.tier_digests]
            self._pending_loads.extend((key, block_id) for key, block_id in zip(keys, ids, strict=True) if block_id != NULL_BLOCK_ID)
        return TierLoad(list(computed.tier_digests), computed.state_key)

    def count_tier_lookup(self, computed: ComputedBlocks) -> None:
        """An admission that loads nothing from the tier: count its misses and skips."""
        if self.tier is not None:
            self.tier.stats.num_miss_blocks += computed.num_tier_misses
            self.tier.stats.num_skipped_blocks += computed.num_tier_skipped

    # ------------------------------------------------------------------ writes

    def _offer_block(self, request: Request, block_hash: BlockHash, block_id: int, group: int = 0) -> None:
        """A block just cached (in KV cache group `group`): queue it for the tier unless
        it is there or on its way."""
        if self.tier is not None and request.lora_request is None:
            digest = group_key(block_digest(block_hash), group)
            if self.tier.offer_write(digest):
                self._pending_offloads.append((digest, block_id))

    def end_snapshot_step(self, failed: bool = False) -> None:
        """The step that took the planned snapshots is done (or failed: they are
        forgotten); the ones taken are queued for the tier, but those of requests under
        a LoRA adapter (adapter ids are only unique in one process)."""
        adapters, self._adapter_snapshots = self._adapter_snapshots, set()
        for block_hash, slot in self.snapshots.end_step(failed):
            if self.tier is not None and block_hash not in adapters:
                key = state_key(block_digest(block_hash))
                if self.tier.offer_write(key, state=True):
                    self._pending_state_offloads.append((key, slot))

    def has_unsent_tier_work(self) -> bool:
        """Writes decided (or snapshots taken) that no SchedulerOutput carried yet."""
        return self.tier is not None and bool(
            self._pending_offloads or self._pending_state_offloads or self.snapshots.num_planned
        )

    def take_pending_offloads(self) -> list[tuple[bytes, int]]:
        """(digest, device block) of blocks to write to the tier, decided since the last
        call. The runner copies them before anything of the next step writes a block."""
        offloads, self._pending_offloads = self._pending_offloads, []
        return offloads

    def take_pending_state_offloads(self) -> list[tuple[bytes, int]]:
        """(tier key, snapshot slot) of a hybrid's snapshots to write to the tier; the
        runner copies them before the step's forward pass takes new snapshots."""
        offloads, self._pending_state_offloads = self._pending_state_offloads, []
        return offloads

    def take_pending_loads(self) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
        """The loads of the admissions since the last call: (digest, device block) and
        (tier key, state slot)."""
        loads, self._pending_loads = self._pending_loads, []
        state_loads, self._pending_state_loads = self._pending_state_loads, []
        return loads, state_loads


__all__ = ["KVTierAccess", "TierLoad", "TierLookup"]
