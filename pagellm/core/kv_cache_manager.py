"""Core stage: KV cache manager: per-request block tables over the block pools.

The manager answers "can this request get room for N more tokens?" and keeps the
block tables; it never decides what to preempt (it returns None when there is no room
and leaves that choice to the scheduler). It also owns the prefix cache policy (which
full blocks are registered, and when) and the host pool used for swapping.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

from pagellm.config import CacheConfig
from pagellm.config.units import cdiv
from pagellm.core.kv_events import KVEventLog
from pagellm.core.block_pool import BlockPool
from pagellm.request import Request

logger = logging.getLogger(__name__)


class ComputedBlocks(NamedTuple):
    """Prefix-cache hit of a request about to be admitted."""

    blocks: list[int]  # ids of the cached device blocks, in table order
    num_computed_tokens: int  # tokens whose KV those blocks already hold


@dataclasses.dataclass
class KVCacheStats:
    """Cumulative counters since the manager was created."""

    num_prefix_query_tokens: int = 0  # tokens of admitted requests looked up
    num_prefix_hit_tokens: int = 0  # of those, tokens found in the cache
    num_allocation_attempts: int = 0
    num_allocation_failures: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0


class KVCacheManager:
    """Block tables of the requests that hold blocks, on device or on host."""

    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = cache_config.enable_prefix_caching
        self.device_pool = BlockPool(
            cache_config.num_gpu_blocks, enable_caching=self.enable_caching
        )
        # Host blocks only hold swapped-out KV; nothing is looked up there.
        self.host_pool = BlockPool(
            cache_config.num_cpu_blocks, enable_caching=False, reserve_null_block=False
        )
        self._block_tables: dict[str, list[int]] = {}
        self._host_block_tables: dict[str, list[int]] = {}
        # Leading blocks of each device table already registered or found in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Forked requests whose last (partial) block is still shared with the parent:
        # it is copied the first time they are given slots (copy-on-write).
        self._copy_on_write: set[str] = set()
        self._pending_copies: list[tuple[int, int]] = []
        self.stats = KVCacheStats()
        self.events: KVEventLog | None = None

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

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's device block table (empty if it holds none)."""
        return list(self._block_tables.get(request_id, ()))

    def num_device_blocks(self, request_id: str) -> int:
        return len(self._block_tables.get(request_id, ()))

    def get_host_block_ids(self, request_id: str) -> list[int]:
        return list(self._host_block_tables.get(request_id, ()))

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def make_stats(self) -> KVCacheStats:
        return dataclasses.replace(self.stats)

    # ------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least the last token is always left to compute, because its logits are what
        the next token is sampled from: a fully cached prompt whose length is a multiple
        of block_size loses its last block from the hit. Nothing is reserved here; pass
        the result to allocate_slots.
        """
        assert request.request_id not in self._block_tables, "request already holds blocks"
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        hashes = request.get_block_hashes(self.block_size)
        max_hit_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        hit_ids: list[int] = []
        for index in range(max_hit_blocks):
            block = self.device_pool.get_cached_block(hashes[index])
            if block is None:
                break
            assert block.block_hash is not None
            if block.block_hash is not hashes[index]:
                request.adopt_cached_block_hash(index, block.block_hash)
            hit_ids.append(block.block_id)
        return ComputedBlocks(hit_ids, len(hit_ids) * self.block_size)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now written (computed).

        Called once the runner has executed the step that computed those tokens, so a
        block is never hit before its content exists.
        """
        if not self.enable_caching:
            return
        request_id = request.request_id
        table = self._block_tables[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = request.get_block_hashes(self.block_size)
        blocks = self.device_pool.blocks
        newly_cached = []
        for index in range(start, num_full):
            if self.device_pool.cache_block(blocks[table[index]], hashes[index]):
                newly_cached.append(table[index])
        self._num_cached_blocks[request_id] = num_full
        if self.events is not None and newly_cached:
            self.events.record("cache", request_id, newly_cached)

    def reset_prefix_cache(self) -> int:
        return self.device_pool.reset_prefix_cache()

    # ------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Grow the request's table to hold its computed tokens plus `num_new_tokens`.

        `new_computed_blocks` (from get_computed_blocks, at admission only) become the
        head of the table and count as computed. Returns the ids of the newly allocated
        blocks, or None when the pool lacks room, in which case nothing at all changed
        (the hit blocks are not touched either).
        """
        assert num_new_tokens >= 0
        request_id = request.request_id
        table = self._block_tables.get(request_id, [])
        hit_ids = new_computed_blocks.blocks if new_computed_blocks is not None else []
        num_hit_tokens = (
            new_computed_blocks.num_computed_tokens if new_computed_blocks is not None else 0
        )
        assert not hit_ids or not table, "prefix hits only at admission"

        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        assert num_tokens <= self.max_model_len, f"{request} would exceed max_model_len"
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(table) - len(hit_ids))
        pool = self.device_pool
        hit_blocks = [pool.blocks[block_id] for block_id in hit_ids]
        # Hit blocks sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        copy_last = self._needs_copy_on_write(request_id, table)

        self.stats.num_allocation_attempts += 1
        if num_new_blocks + num_free_hits + int(copy_last) > pool.num_free_blocks:
            self.stats.num_allocation_failures += 1
            return None

        if copy_last:
            self._copy_last_block(request_id, table)
        # Touch before allocating so the allocation cannot evict a block being hit.
        pool.touch(hit_blocks)
        new_blocks = pool.allocate(num_new_blocks)
        new_ids = [block.block_id for block in new_blocks]
        if request_id not in self._block_tables:
            self._block_tables[request_id] = table
            self._num_cached_blocks[request_id] = len(hit_ids)
        table.extend(hit_ids)
        table.extend(new_ids)
        if self.events is not None:
            if hit_ids:
                self.events.record("cache_hit", request_id, hit_ids)
            if new_ids:
                self.events.record("allocate", request_id, new_ids)
        if new_computed_blocks is not None and self.enable_caching:
            self.stats.num_prefix_query_tokens += request.num_tokens
            self.stats.num_prefix_hit_tokens += num_hit_tokens
        return new_ids

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the blocks past the first `num_tokens` positions (slots allocated for
        positions that were not kept: a rejected speculative proposal). Returns how many."""
        table = self._block_tables.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return 0
        dropped = table[keep:]
        del table[keep:]
        blocks = self.device_pool.blocks
        self.device_pool.free(blocks[block_id] for block_id in reversed(dropped))
        if self.events is not None:
            self.events.record("free", request.request_id, reversed(dropped))
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
        table = self._block_tables[parent.request_id][:num_blocks]
        assert len(table) == num_blocks, f"{parent} lacks blocks for its prompt"
        self.device_pool.touch(self.device_pool.blocks[block_id] for block_id in table)
        self._block_tables[child.request_id] = list(table)
        if self.events is not None:
            self.events.record("fork", child.request_id, table, parent_id=parent.request_id)
        self._num_cached_blocks[child.request_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), child.num_computed_tokens // self.block_size
        )
        if child.num_computed_tokens % self.block_size:
            self._copy_on_write.add(child.request_id)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, target) device block copies decided since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _needs_copy_on_write(self, request_id: str, table: list[int]) -> bool:
        if request_id not in self._copy_on_write:
            return False
        block = self.device_pool.blocks[table[-1]]
        # A hash means the block was filled (by the parent) and is in the prefix cache
        # under that content: writing this request's tokens into it would corrupt the
        # cache, even when no one else holds it any more.
        if block.ref_cnt > 1 or block.block_hash is not None:
            return True
        # Everyone else let go of the block: it is this request's own now.
        self._copy_on_write.discard(request_id)
        return False

    def _copy_last_block(self, request_id: str, table: list[int]) -> None:
        pool = self.device_pool
        shared = pool.blocks[table[-1]]
        [private] = pool.allocate(1)
        table[-1] = private.block_id
        pool.free([shared])
        self._pending_copies.append((shared.block_id, private.block_id))
        if self.events is not None:
            self.events.record("copy_on_write", request_id, [shared.block_id, private.block_id])
        self._copy_on_write.discard(request_id)

    def free(self, request: Request) -> None:
        """Release every block the request holds, on device and on host."""
        self._free_device(request.request_id)
        host_ids = self._host_block_tables.pop(request.request_id, None)
        if host_ids:
            blocks = self.host_pool.blocks
            self.host_pool.free(blocks[block_id] for block_id in reversed(host_ids))

    def _free_device(self, request_id: str) -> None:
        self._num_cached_blocks.pop(request_id, None)
        self._copy_on_write.discard(request_id)
        table = self._block_tables.pop(request_id, None)
        if table:
            # Tail first: the free queue evicts from its head, so the end of a chain
            # (the least likely to be shared) goes before its beginning.
            blocks = self.device_pool.blocks
            self.device_pool.free(blocks[block_id] for block_id in reversed(table))
            if self.events is not None:
                self.events.record("free", request_id, reversed(table))

    # ------------------------------------------------------------------- swap

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's computed KV to host blocks and free its device blocks.

        Returns (device_block_id, host_block_id) copy pairs, or None (nothing changed)
        when the host pool lacks room. Every block holding computed tokens is copied,
        shared prefix-cache blocks included (the request only drops its reference on
        those); blocks allocated for tokens not computed yet are freed without a copy.
        """
        request_id = request.request_id
        table = self._block_tables.get(request_id, [])
        num_to_copy = min(len(table), cdiv(request.num_computed_tokens, self.block_size))
        if num_to_copy > self.host_pool.num_free_blocks:
            return None
        host_blocks = self.host_pool.allocate(num_to_copy)
        host_ids = [block.block_id for block in host_blocks]
        pairs = list(zip(table[:num_to_copy], host_ids))
        if self.events is not None:
            self.events.record("swap_out", request_id, table[:num_to_copy], host_block_ids=host_ids)
        self._free_device(request_id)
        self._host_block_tables[request_id] = host_ids
        self.stats.num_swapped_out_blocks += num_to_copy
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether swap_in and then allocate_slots(request, num_new_tokens) will succeed."""
        num_host_blocks = len(self._host_block_tables.get(request.request_id, ()))
        num_needed = max(
            num_host_blocks,
            cdiv(request.num_computed_tokens + num_new_tokens, self.block_size),
        )
        return num_needed <= self.device_pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Move a swapped-out request's KV back to fresh device blocks.

        Returns (host_block_id, device_block_id) copy pairs, or None (nothing changed)
        when the device pool lacks room. The host blocks are freed at once, so the
        caller must not swap anything out later in the same step (the runner copies
        swap-outs before swap-ins and would overwrite them).
        """
        request_id = request.request_id
        host_ids = self._host_block_tables.get(request_id)
        assert host_ids is not None, f"{request} is not swapped out"
        assert request_id not in self._block_tables, f"{request} holds device blocks"
        if len(host_ids) > self.device_pool.num_free_blocks:
            return None
        device_blocks = self.device_pool.allocate(len(host_ids))
        device_ids = [block.block_id for block in device_blocks]
        del self._host_block_tables[request_id]
        host_blocks = self.host_pool.blocks
        self.host_pool.free(host_blocks[block_id] for block_id in reversed(host_ids))
        self._block_tables[request_id] = device_ids
        if self.events is not None:
            self.events.record("swap_in", request_id, device_ids, host_block_ids=host_ids)
        # The copies hold the same content, but are registered again only once the
        # runner has done the copy (cache_blocks after the step).
        self._num_cached_blocks[request_id] = 0
        self.stats.num_swapped_in_blocks += len(host_ids)
        return list(zip(host_ids, device_ids))

    # -------------------------------------------------------------- integrity

    def check_integrity(self, requests: Iterable[Request] = ()) -> None:
        """Raise AssertionError unless pools and tables agree on every reference.

        For the given requests (those on device), also check that every cached block in
        their tables holds exactly the content of that position of the request.
        """
        for pool, tables in (
            (self.device_pool, self._block_tables),
            (self.host_pool, self._host_block_tables),
        ):
            pool.check_integrity()
            refs: Counter[int] = Counter()
            for request_id, table in tables.items():
                assert len(set(table)) == len(table), f"{request_id} holds a block twice"
                refs.update(table)
            for block in pool.blocks:
                assert block.ref_cnt == refs.get(block.block_id, 0), (
                    f"{block} has ref count {block.ref_cnt} but "
                    f"{refs.get(block.block_id, 0)} tables hold it"
                )
        both = self._block_tables.keys() & self._host_block_tables.keys()
        assert not both, f"requests on device and host at once: {sorted(both)}"
        if self.enable_caching:
            for request in requests:
                table = self._block_tables.get(request.request_id, [])
                hashes = request.get_block_hashes(self.block_size)
                for index, block_id in enumerate(table):
                    block_hash = self.device_pool.blocks[block_id].block_hash
                    # A forked request's shared last block, not copied yet, holds the
                    # parent's tokens after the prompt: the copy comes before any write.
                    pending_copy = request.request_id in self._copy_on_write and index == len(table) - 1
                    if block_hash is not None and not pending_copy:
                        assert index < len(hashes) and block_hash == hashes[index], (
                            f"{request} shares block {block_id} holding other tokens"
                        )

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._block_tables or request_id in self._host_block_tables

    def is_swapped_out(self, request_id: str) -> bool:
        return request_id in self._host_block_tables

    def request_ids_holding_blocks(self) -> set[str]:
        return self._block_tables.keys() | self._host_block_tables.keys()


__all__ = ["ComputedBlocks", "KVCacheManager", "KVCacheStats"]
