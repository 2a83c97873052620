"""Core stage: swapping a preempted request's KV to host blocks and back.

Under preemption mode "swap" the scheduler moves a running request's computed KV to the
host pool (swap_out) instead of dropping it, and brings it back to fresh device blocks
(swap_in) when there is room; the runner copies the blocks. A sliding-window group keeps
only its live blocks on the host, with the count of NULL entries (blocks the window had
passed) before them, so the table is rebuilt the same length.

A mixin of KVCacheManager (core/kv_cache_manager.py), which owns the pools and tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pagellm.config.units import cdiv
from pagellm.core.block_pool import NULL_BLOCK_ID, BlockPool
from pagellm.core.scheduler_output import StateSwaps
from pagellm.request import Request

if TYPE_CHECKING:
    from pagellm.core.kv_events import KVEventLog
    from pagellm.core.state_slots import StateSlots


class HostCopy(NamedTuple):
    """A swapped-out request's KV: per group, the host blocks of its live entries and how
    many NULL entries (passed by the window) precede them."""

    block_ids: list[list[int]]
    num_skipped: list[int]


class KVSwap:
    """swap_out, can_swap_in and swap_in on KVCacheManager's state (declared here for
    readers; a swapped-out request's device blocks go through KVCacheManager._free_device,
    and the moves are counted in its stats)."""

    block_size: int
    num_groups: int
    device_pool: BlockPool
    host_pool: BlockPool
    events: KVEventLog | None
    _block_tables: dict[str, list[list[int]]]
    _host_copies: dict[str, HostCopy]
    _num_cached_blocks: dict[str, int]
    state_slots: StateSlots
    host_state_slots: StateSlots
    _pending_state_swaps: StateSwaps
    _pending_restores: list[tuple[int, int]]

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's computed KV to host blocks and free its device blocks.

        Returns (device_block_id, host_block_id) copy pairs, or None (nothing changed)
        when the host pool lacks room. Every block holding computed tokens is copied,
        shared prefix-cache blocks included (the request only drops its reference on
        those); blocks allocated for tokens not computed yet, and the NULL entries of
        blocks a window freed, are not.
        """
        request_id = request.request_id
        tables = self._block_tables.get(request_id, [])
        num_to_copy = min(len(tables[0]) if tables else 0, cdiv(request.num_computed_tokens, self.block_size))
        live = [[b for b in table[:num_to_copy] if b != NULL_BLOCK_ID] for table in tables]
        num_live = sum(map(len, live))
        if num_live > self.host_pool.num_free_blocks:
            return None
        if self.state_slots.enabled:  # a hybrid's state goes to a host slot, or nothing moves
            device_slot = self.state_slots.slot_of(request_id)
            # Swap-outs are copied first in a step: a slot a copy fills later in the same
            # step (a fork's, a snapshot's) does not hold the request's state yet.
            filling = self.state_slots.awaits_copy(request_id) or any(dst == device_slot for _, dst in self._pending_restores)
            if not self.host_state_slots.num_free or device_slot is None or filling:
                return None
            self._pending_state_swaps.out.append((device_slot, self.host_state_slots.allocate(request_id)))
        host_tables = [[block.block_id for block in self.host_pool.allocate(len(ids))] for ids in live]
        device_ids = [b for ids in live for b in ids]
        host_ids = [b for ids in host_tables for b in ids]
        if self.events is not None:
            self.events.record("swap_out", request_id, device_ids, host_block_ids=host_ids)
        num_skipped = [len(table[:num_to_copy]) - len(ids) for table, ids in zip(tables, live)]
        self._free_device(request_id)
        self._host_copies[request_id] = HostCopy(host_tables, num_skipped)
        self.stats.num_swapped_out_blocks += num_live
        return list(zip(device_ids, host_ids))

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether swap_in and then allocate_slots(request, num_new_tokens) will succeed."""
        copy = self._host_copies.get(request.request_id)
        num_blocks = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_needed = 0
        for group in range(self.num_groups):
            num_host = len(copy.block_ids[group]) if copy else 0
            num_skipped = copy.num_skipped[group] if copy else 0
            num_needed += max(num_host, num_blocks - num_skipped)
        if self.state_slots.enabled and not self.state_slots.num_free:
            return False
        return num_needed <= self.device_pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Move a swapped-out request's KV back to fresh device blocks.

        Returns (host_block_id, device_block_id) copy pairs, or None (nothing changed)
        when the device pool lacks room. The host blocks are freed at once, so the
        caller must not swap anything out later in the same step (the runner copies
        swap-outs before swap-ins and would overwrite them).
        """
        request_id = request.request_id
        copy = self._host_copies.get(request_id)
        assert copy is not None, f"{request} is not swapped out"
        assert request_id not in self._block_tables, f"{request} holds device blocks"
        num_blocks = sum(map(len, copy.block_ids))
        if num_blocks > self.device_pool.num_free_blocks or (self.state_slots.enabled and not self.state_slots.num_free):
            return None
        del self._host_copies[request_id]
        if self.state_slots.enabled:  # its state back from its host slot into a device one
            host_slot = self.host_state_slots.slot_of(request_id)
            assert host_slot is not None, f"{request} was swapped out without its state"
            self.host_state_slots.free(request_id)
            self._pending_state_swaps.into.append((host_slot, self.state_slots.allocate(request_id)))
        tables: list[list[int]] = []
        pairs: list[tuple[int, int]] = []
        host_blocks = self.host_pool.blocks
        for host_ids, num_skipped in zip(copy.block_ids, copy.num_skipped):
            device_ids = [block.block_id for block in self.device_pool.allocate(len(host_ids))]
            self.host_pool.free(host_blocks[block_id] for block_id in reversed(host_ids))
            tables.append([NULL_BLOCK_ID] * num_skipped + device_ids)
            pairs.extend(zip(host_ids, device_ids))
        self._block_tables[request_id] = tables
        if self.events is not None:
            self.events.record(
                "swap_in", request_id, [d for _, d in pairs], host_block_ids=[h for h, _ in pairs]
            )
        # The copies hold the same content, but are registered again only once the
        # runner has done the copy (cache_blocks after the step).
        self._num_cached_blocks[request_id] = 0
        self.stats.num_swapped_in_blocks += num_blocks
        return pairs
