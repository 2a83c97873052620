"""Core stage: KV cache manager: per-request block tables over the block pools.

The manager answers "can this request get room for N more tokens?" and keeps the
block tables; it never decides what to preempt (it returns None when there is no room
and leaves that choice to the scheduler). It also owns the prefix cache policy (which
full blocks are registered, and when) and the host pool used for swapping.

A request has one block table per KV cache group (config/kv_layout.py: most models have
one group; a model that mixes global and sliding-window layers has several), all of the
same length: entry i of every table covers tokens i * block_size .. (i + 1) * block_size - 1
for that group's layers. All tables draw on the one device pool. A sliding group no longer
needs the blocks its window has passed: after each step they are freed and their entries
become NULL_BLOCK_ID (always a run at the table's start), so a long request holds a window
of blocks in its sliding groups and all of them in its global ones.

With a second tier (core/kv_tier.py), every block registered in the prefix cache is also
queued for writing to the tier (one entry per KV cache group), and a lookup that
misses the device cache continues in the tier: the blocks found there are allocated
fresh and loaded (allocate_for_load) before the request computes anything. A hybrid's
snapshots go there too (core/kv_tier_access.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from pagellm.config import CacheConfig
from pagellm.config.units import cdiv
from pagellm.core.kv_events import KVEventLog
from pagellm.core.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from pagellm.core.kv_cache_integrity import check_kv_cache_integrity
from pagellm.core.kv_swap import HostCopy, KVSwap
from pagellm.core.scheduler_output import StateSwaps
from pagellm.core.kv_tier import TierCostModel, TierIndex
from pagellm.core.kv_cache_records import NO_HIT, ComputedBlocks, KVCacheStats
from pagellm.core.kv_tier_access import KVTierAccess, TierLookup
from pagellm.core.state_slots import StateSlots
from pagellm.core.state_snapshots import StateSnapshots
from pagellm.request import BlockHash, Request

logger = logging.getLogger(__name__)


class KVCacheManager(KVSwap, KVTierAccess):
    """Block tables of the requests that hold blocks, on device or on host (swap_out and
    swap_in: core/kv_swap.py), and the prefix cache's tier (core/kv_tier_access.py)."""

    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = cache_config.enable_prefix_caching
        self.group_windows = cache_config.group_windows
        self.num_groups = len(self.group_windows)
        self.device_pool = BlockPool(
            cache_config.num_gpu_blocks, enable_caching=self.enable_caching
        )
        # Host blocks only hold swapped-out KV; nothing is looked up there.
        self.host_pool = BlockPool(
            cache_config.num_cpu_blocks, enable_caching=False, reserve_null_block=False
        )
        self._block_tables: dict[str, list[list[int]]] = {}
        self._host_copies: dict[str, HostCopy] = {}
        # Leading blocks of each device table already registered or found in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Forked requests whose last (partial) blocks are still shared with the parent:
        # they are copied the first time they are given slots (copy-on-write).
        self._copy_on_write: set[str] = set()
        self._pending_copies: list[tuple[int, int]] = []
        self.stats = KVCacheStats()
        self.events: KVEventLog | None = None
        # The prefix cache's second tier: only under prefix caching. Each KV cache group's
        # block is an entry of its own (core/kv_tier.group_key); a block index is in the
        # tier when every group's entry is.
        self.tier: TierIndex | None = None
        if cache_config.kv_offload_bytes and self.enable_caching:
            self.tier = TierIndex(cache_config.kv_offload_bytes, cache_config.kv_offload_max_pending_writes)
        self.tier_cost = TierCostModel(self.block_size)
        self._pending_offloads: list[tuple[bytes, int]] = []  # (digest, device block)
        self._pending_loads: list[tuple[bytes, int]] = []
        self._pending_state_offloads: list[tuple[bytes, int]] = []  # (tier key, snapshot slot)
        self._pending_state_loads: list[tuple[bytes, int]] = []  # (tier key, state slot)
        self._adapter_snapshots: set[BlockHash] = set()  # planned this step by requests under an adapter
        # A hybrid model's recurrent-state slots: one for each request holding device blocks;
        # with prefix caching, the snapshots that let a hit resume (dropped with their block).
        self.state_slots = StateSlots(cache_config.num_state_slots)
        self.snapshots = StateSnapshots(
            cache_config.num_state_snapshots if self.enable_caching else 0, cache_config.state_snapshot_interval
        )
        if self.snapshots.enabled:
            self.device_pool.on_forget = self.snapshots.drop
        self._pending_restores: list[tuple[int, int]] = []
        # Swap preemption of a hybrid: a swapped-out request's state waits in a host slot.
        self.host_state_slots = StateSlots(cache_config.num_host_state_slots)
        self._pending_state_swaps: StateSwaps = StateSwaps([], [])

    def set_event_log(self, events: KVEventLog | None) -> None:
        """Record every block event to `events` (None: stop recording)."""
        self.events = events
        self.device_pool.on_evict = (
            None if events is None else (lambda ids: events.record("evict", block_ids=ids))
        )

    # ----------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return self.device_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.device_pool.num_usable_blocks

    def get_usage(self) -> float:
        return self.device_pool.get_usage()

    def get_host_usage(self) -> float:
        return self.host_pool.get_usage()

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """A copy of the request's device block table of one KV cache group (empty if it
        holds none); NULL_BLOCK_ID where a sliding window freed the block."""
        tables = self._block_tables.get(request_id)
        return list(tables[group]) if tables else []

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """Copies of the request's device block tables, one per KV cache group."""
        return [list(table) for table in self._block_tables.get(request_id, ())]

    def num_device_blocks(self, request_id: str) -> int:
        """Length of each of the request's device tables (NULL entries included)."""
        tables = self._block_tables.get(request_id)
        return len(tables[0]) if tables else 0

    def num_blocks_held(self, request_id: str) -> int:
        """Device blocks the request references, over every group."""
        tables = self._block_tables.get(request_id, ())
        return sum(1 for table in tables for block_id in table if block_id != NULL_BLOCK_ID)

    def get_host_block_ids(self, request_id: str) -> list[int]:
        copy = self._host_copies.get(request_id)
        return [block_id for table in copy.block_ids for block_id in table] if copy else []

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def has_sliding_groups(self) -> bool:
        return any(window is not None for window in self.group_windows)

    def num_passed_blocks(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks of a group's table that no layer of it reads again once
        `num_computed_tokens` are computed: the next query, at that position, sees keys
        from position num_computed_tokens - window + 1 on. 0 for a global group."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def make_stats(self) -> KVCacheStats:
        return dataclasses.replace(self.stats)

    # ------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least the last token is always left to compute, because its logits are what
        the next token is sampled from: a fully cached prompt whose length is a multiple
        of block_size loses its last block from the hit. A global group needs every block
        of the hit cached; a sliding group only those its window still reads after it
        (the others enter the table as NULL_BLOCK_ID). Nothing is reserved here; pass the
        result to allocate_slots.
        """
        assert request.request_id not in self._block_tables, "request already holds blocks"
        if not self.enable_caching or (self.state_slots.enabled and not self.snapshots.enabled):
            return NO_HIT
        hashes = request.get_block_hashes(self.block_size)
        max_hit_blocks = lookup_limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        pool = self.device_pool
        found: list[list[KVBlock | None]] = []
        for group in range(self.num_groups):
            blocks: list[KVBlock | None] = []
            for index in range(max_hit_blocks):
                block = pool.get_cached_block(hashes[index], group)
                if block is None and self.group_windows[group] is None:
                    break  # a global group's hit ends at its first miss
                blocks.append(block)
            max_hit_blocks = min(max_hit_blocks, len(blocks)) if self.group_windows[group] is None else max_hit_blocks
            found.append(blocks)
        num_hit = self._longest_hit(found, max_hit_blocks)
        if self.state_slots.enabled:  # a hybrid resumes from its last snapshot within the hit
            lookup = self._hybrid_lookup(request, hashes, found, num_hit, lookup_limit)
        else:
            lookup = self._tier_lookup(request, hashes, num_hit, lookup_limit)
        num_hit = lookup.num_hit_blocks
        if num_hit == 0 and not lookup.digests and lookup.state_key is None:
            return ComputedBlocks([], 0, (), lookup.num_misses, lookup.num_skipped) if self.tier is not None else NO_HIT
        tables: list[list[int]] = []
        for group, blocks in enumerate(found):
            skipped = self.num_passed_blocks(group, num_hit * self.block_size)
            table = [NULL_BLOCK_ID] * skipped
            for index in range(skipped, num_hit):
                block = blocks[index]
                assert block is not None and block.block_hash is not None
                if block.block_hash is not hashes[index]:
                    request.adopt_cached_block_hash(index, block.block_hash)
                table.append(block.block_id)
            tables.append(table)
        return ComputedBlocks(
            tables, num_hit * self.block_size, lookup.digests, lookup.num_misses, lookup.num_skipped,
            lookup.snapshot_slot, lookup.state_key,
        )  # fmt: skip

    def _hybrid_lookup(
        self, request: Request, hashes: list[BlockHash], found: list[list[KVBlock | None]], num_hit: int, max_hit_blocks: int
    ) -> TierLookup:
        """Where a hybrid's request resumes: after its last snapshot within the device hit,
        or further on with the tier's blocks and snapshots (core/kv_tier_access.py)."""

        def holds(num_blocks: int) -> bool:  # every group has the blocks a hit of this length reads
            return all(
                all(block is not None for block in blocks[self.num_passed_blocks(group, num_blocks * self.block_size) : num_blocks])
                for group, blocks in enumerate(found)
            )  # fmt: skip

        resume = self.snapshots.resume_point(hashes, num_hit, holds)
        device_resume, device_slot = resume if resume is not None else (0, None)
        tiered = self._hybrid_tier_lookup(request, hashes, num_hit, device_resume, max_hit_blocks)
        if tiered is None or not tiered.digests and tiered.state_key is None:
            misses, skipped = (tiered.num_misses, tiered.num_skipped) if tiered is not None else (0, 0)
            tiered = TierLookup((), misses, skipped, device_resume, device_slot)
        end = tiered.num_hit_blocks + len(tiered.digests)
        if end:
            self.snapshots.claim(request.request_id, hashes[end - 1])
        return tiered

    def _longest_hit(self, found: list[list[KVBlock | None]], max_hit_blocks: int) -> int:
        """The most blocks h <= max_hit_blocks such that every sliding group has the
        blocks its window reads after position h * block_size cached."""
        misses: list[list[int]] = []  # per sliding group, misses among its first i blocks
        sliding = [g for g in range(self.num_groups) if self.group_windows[g] is not None]
        for group in sliding:
            counts = [0]
            for block in found[group][:max_hit_blocks]:
                counts.append(counts[-1] + (block is None))
            misses.append(counts)
        for num_hit in range(max_hit_blocks, 0, -1):
            if all(
                counts[num_hit] == counts[self.num_passed_blocks(group, num_hit * self.block_size)]
                for group, counts in zip(sliding, misses)
            ):
                return num_hit
        return 0

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now written (computed).

        Called once the runner has executed the step that computed those tokens, so a
        block is never hit before its content exists.
        """
        if not self.enable_caching:
            return
        request_id = request.request_id
        tables = self._block_tables[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(tables[0]))
        start = self._num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = request.get_block_hashes(self.block_size)
        blocks = self.device_pool.blocks
        newly_cached = []
        for group, table in enumerate(tables):
            for index in range(start, num_full):
                block_id = table[index]
                if block_id != NULL_BLOCK_ID and self.device_pool.cache_block(blocks[block_id], hashes[index], group):
                    newly_cached.append(block_id)
                    self._offer_block(request, hashes[index], block_id, group)
        self._num_cached_blocks[request_id] = num_full
        if self.events is not None and newly_cached:
            self.events.record("cache", request_id, newly_cached)

    def reset_prefix_cache(self) -> int:
        return self.device_pool.reset_prefix_cache()

    def forget_device_contents(self) -> None:
        """The device's KV blocks and state snapshots were freed (the engine sleeps, idle):
        nothing cached in them is a hit any more. The disk tier's entries stay hits."""
        self.reset_prefix_cache()
        self.snapshots.forget_all()

    # ------------------------------------------------------------- allocation

    def free_passed_blocks(self, request: Request) -> int:
        """Free the blocks of the request's sliding groups that their windows have passed
        (num_computed_tokens tells where the next query sits). Returns how many."""
        tables = self._block_tables.get(request.request_id)
        if not tables or self.num_groups == 1 and self.group_windows[0] is None:
            return 0
        freed: list[int] = []
        for group, table in enumerate(tables):
            # Backwards from the last passed block to the NULL run already at the start.
            index = min(self.num_passed_blocks(group, request.num_computed_tokens), len(table)) - 1
            while index >= 0 and table[index] != NULL_BLOCK_ID:
                freed.append(table[index])
                table[index] = NULL_BLOCK_ID
                index -= 1
        if freed:
            blocks = self.device_pool.blocks
            self.device_pool.free(blocks[block_id] for block_id in freed)
            self.stats.num_window_freed_blocks += len(freed)
            if self.events is not None:
                self.events.record("free", request.request_id, freed)
        return len(freed)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks | None = None,
    ) -> list[list[int]] | None:
        """Grow the request's tables to hold its computed tokens plus `num_new_tokens`.

        `new_computed_blocks` (from get_computed_blocks, at admission only) become the
        head of the tables and count as computed. Returns the ids of the newly allocated
        blocks per group, or None when the pool lacks room, in which case nothing changed
        but that blocks the windows had passed were freed (they are never read again).
        """
        assert num_new_tokens >= 0
        request_id = request.request_id
        self.free_passed_blocks(request)
        tables = self._block_tables.get(request_id)
        hit_tables = new_computed_blocks.blocks if new_computed_blocks is not None else []
        num_hit_tokens = (
            new_computed_blocks.num_computed_tokens if new_computed_blocks is not None else 0
        )
        assert not hit_tables or not tables, "prefix hits only at admission"

        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        assert num_tokens <= self.max_model_len, f"{request} would exceed max_model_len"
        current = len(tables[0]) if tables else (len(hit_tables[0]) if hit_tables else 0)
        num_new_per_group = max(0, cdiv(num_tokens, self.block_size) - current)
        pool = self.device_pool
        hit_blocks = [pool.blocks[i] for table in hit_tables for i in table if i != NULL_BLOCK_ID]
        # Hit blocks sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        copy_groups = self._groups_to_copy(request_id, tables)
        needed = num_new_per_group * self.num_groups + num_free_hits + len(copy_groups)
        if needed > pool.num_free_blocks and tables is not None:
            copy_groups = self._take_over_cached_blocks(request_id, tables, copy_groups, needed - pool.num_free_blocks)
            needed = num_new_per_group * self.num_groups + num_free_hits + len(copy_groups)

        self.stats.num_allocation_attempts += 1
        needs_state_slot = tables is None and self.state_slots.enabled
        if needed > pool.num_free_blocks or (
            needs_state_slot and not self.state_slots.num_free
        ):
            self.stats.num_allocation_failures += 1
            return None
        if needs_state_slot:
            state_slot = self.state_slots.allocate(request_id)
            if new_computed_blocks is not None and new_computed_blocks.snapshot_slot is not None:
                self._pending_restores.append((new_computed_blocks.snapshot_slot, state_slot))

        if tables is not None:
            self._copy_last_blocks(request_id, tables, copy_groups)
        else:
            tables = self._block_tables[request_id] = [list(table) for table in hit_tables] or [
                [] for _ in range(self.num_groups)
            ]
            self._num_cached_blocks[request_id] = len(tables[0])
        # Touch before allocating so the allocation cannot evict a block being hit.
        pool.touch(hit_blocks)
        new_ids: list[list[int]] = []
        for table in tables:
            ids = [block.block_id for block in pool.allocate(num_new_per_group)]
            table.extend(ids)
            new_ids.append(ids)
        if self.events is not None:
            if hit_blocks:
                self.events.record("cache_hit", request_id, [block.block_id for block in hit_blocks])
            if num_new_per_group:
                self.events.record("allocate", request_id, [i for ids in new_ids for i in ids])
        if new_computed_blocks is not None and self.enable_caching:
            self.stats.num_prefix_query_tokens += request.num_tokens
            self.stats.num_prefix_hit_tokens += num_hit_tokens
        return new_ids

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the blocks past the first `num_tokens` positions (slots allocated for
        positions that were not kept: a rejected speculative proposal). Returns how many."""
        tables = self._block_tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not tables or len(tables[0]) <= keep:
            return 0
        dropped: list[int] = []
        for table in tables:
            dropped.extend(reversed(table[keep:]))
            del table[keep:]
        assert NULL_BLOCK_ID not in dropped, "a window passed a block past the kept positions"
        blocks = self.device_pool.blocks
        self.device_pool.free(blocks[block_id] for block_id in dropped)
        if self.events is not None:
            self.events.record("free", request.request_id, dropped)
        return len(dropped)

    # ------------------------------------------------------ parallel sampling

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's blocks for its first child.num_computed_tokens tokens.

        The blocks are shared (one more reference each), so the prompt's KV is computed
        once for all n completions. A partial last block is copied the first time the
        child gets slots: the parent keeps writing its own tokens after the prompt in it.
        Forking needs no free block, so it cannot fail.
        """
        num_blocks = cdiv(child.num_computed_tokens, self.block_size)
        tables = [table[:num_blocks] for table in self._block_tables[parent.request_id]]
        assert len(tables[0]) == num_blocks, f"{parent} lacks blocks for its prompt"
        shared = [block_id for table in tables for block_id in table if block_id != NULL_BLOCK_ID]
        self.device_pool.touch(self.device_pool.blocks[block_id] for block_id in shared)
        self._block_tables[child.request_id] = tables
        if self.state_slots.enabled:
            self.state_slots.fork(parent.request_id, child.request_id)
        if self.events is not None:
            self.events.record("fork", child.request_id, shared, parent_id=parent.request_id)
        self._num_cached_blocks[child.request_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), child.num_computed_tokens // self.block_size
        )
        if child.num_computed_tokens % self.block_size:
            self._copy_on_write.add(child.request_id)

    def take_pending_state_swaps(self) -> StateSwaps:
        """The state slot copies of the swaps decided since the last call."""
        swaps, self._pending_state_swaps = self._pending_state_swaps, StateSwaps([], [])
        return swaps

    def take_pending_restores(self) -> list[tuple[int, int]]:
        """(snapshot, state slot) copies of the requests admitted on a snapshot since the last call."""
        restores, self._pending_restores = self._pending_restores, []
        return restores

    def plan_state_saves(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """The snapshots a hybrid's request writes while it computes `num_new_tokens` more
        (see StateSnapshots.plan_saves)."""
        if not self.snapshots.enabled:
            return []
        start = request.num_computed_tokens
        hashes = request.get_block_hashes(self.block_size)
        saves = self.snapshots.plan_saves(request.request_id, hashes, start, start + num_new_tokens, self.block_size)
        if saves and request.lora_request is not None:  # kept out of the tier (end_snapshot_step)
            self._adapter_snapshots.update(hashes[(start + offset) // self.block_size - 1] for offset, _ in saves)
        return saves

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, target) device block copies decided since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _groups_to_copy(self, request_id: str, tables: list[list[int]] | None) -> list[int]:
        """The groups whose shared last block a forked request must copy before writing."""
        if tables is None or request_id not in self._copy_on_write:
            return []
        copy = []
        for group, table in enumerate(tables):
            block = self.device_pool.blocks[table[-1]]
            # A hash means the block was filled (by the parent) and is in the prefix cache
            # under that content: writing this request's tokens into it would corrupt the
            # cache, even when no one else holds it any more.
            if block.ref_cnt > 1 or block.block_hash is not None:
                copy.append(group)
        if not copy:  # everyone else let go of the blocks: they are this request's own now
            self._copy_on_write.discard(request_id)
        return copy

    def _take_over_cached_blocks(
        self, request_id: str, tables: list[list[int]], copy_groups: list[int], shortage: int
    ) -> list[int]:
        """Where the pool lacks the blocks a fork's copies need: the shared last blocks that
        only the parent's cache entry still holds (ref count 1) leave the prefix cache and
        are written in place, if that makes up the shortage (else nothing changes, and the
        scheduler preempts). Returns the groups still to copy."""
        blocks = self.device_pool.blocks
        sole = [group for group in copy_groups if blocks[tables[group][-1]].ref_cnt == 1]
        if len(sole) < shortage:
            return copy_groups
        for group in sole:
            self.device_pool.forget(blocks[tables[group][-1]])
        remaining = [group for group in copy_groups if group not in sole]
        if not remaining:
            self._copy_on_write.discard(request_id)
        return remaining

    def _copy_last_blocks(self, request_id: str, tables: list[list[int]], groups: list[int]) -> None:
        pool = self.device_pool
        for group in groups:
            table = tables[group]
            shared = pool.blocks[table[-1]]
            [private] = pool.allocate(1)
            table[-1] = private.block_id
            pool.free([shared])
            self._pending_copies.append((shared.block_id, private.block_id))
            if self.events is not None:
                self.events.record("copy_on_write", request_id, [shared.block_id, private.block_id])
        if groups:
            self._copy_on_write.discard(request_id)

    def free(self, request: Request) -> None:
        """Release every block the request holds, on device and on host."""
        self._free_device(request.request_id)
        self.host_state_slots.free(request.request_id)
        copy = self._host_copies.pop(request.request_id, None)
        if copy is not None:
            blocks = self.host_pool.blocks
            for table in copy.block_ids:
                self.host_pool.free(blocks[block_id] for block_id in reversed(table))

    def _free_device(self, request_id: str) -> None:
        slot = self.state_slots.slot_of(request_id)
        if slot is not None:  # a copy into the slot not made yet is dropped with it
            self._pending_restores = [(src, dst) for src, dst in self._pending_restores if dst != slot]
            self._pending_state_swaps.into[:] = [(src, dst) for src, dst in self._pending_state_swaps.into if dst != slot]
        self.state_slots.free(request_id)
        self.snapshots.forget_request(request_id)
        self._num_cached_blocks.pop(request_id, None)
        self._copy_on_write.discard(request_id)
        tables = self._block_tables.pop(request_id, None)
        if tables:
            # Tail first: the free queue evicts from its head, so the end of a chain
            # (the least likely to be shared) goes before its beginning.
            freed = [block_id for table in tables for block_id in reversed(table) if block_id != NULL_BLOCK_ID]
            blocks = self.device_pool.blocks
            self.device_pool.free(blocks[block_id] for block_id in freed)
            if self.events is not None:
                self.events.record("free", request_id, freed)

    # -------------------------------------------------------------- integrity

    def check_integrity(self, requests: Iterable[Request] = ()) -> None:
        """Raise AssertionError unless pools and tables agree on every reference; for the
        given requests (those on device) also their cached contents and windows
        (core/kv_cache_integrity.py)."""
        check_kv_cache_integrity(
            device_pool=self.device_pool,
            host_pool=self.host_pool,
            device_tables=self._block_tables,
            host_tables={rid: copy.block_ids for rid, copy in self._host_copies.items()},
            num_groups=self.num_groups,
            passed_blocks=self.num_passed_blocks,
            block_size=self.block_size if self.enable_caching else None,
            copy_on_write=self._copy_on_write,
            tier=self.tier,
            requests=requests,
        )
        if self.state_slots.enabled:
            self.state_slots.check_integrity(set(self._block_tables))
        if self.host_state_slots.enabled:
            self.host_state_slots.check_integrity(set(self._host_copies))
        if self.snapshots.enabled:
            self.snapshots.check_integrity()

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._block_tables or request_id in self._host_copies

    def is_swapped_out(self, request_id: str) -> bool:
        return request_id in self._host_copies

    def request_ids_holding_blocks(self) -> set[str]:
        return self._block_tables.keys() | self._host_copies.keys()


__all__ = ["NO_HIT", "ComputedBlocks", "KVCacheManager", "KVCacheStats"]
