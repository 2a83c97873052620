"""Core stage: snapshots of a hybrid model's recurrent state at block boundaries, for prefix
caching.

A prefix hit on a model with linear-attention layers needs, beside the K/V of the hit's
blocks, the recurrent state after exactly those tokens. So while a request computes, the
state it has at the last multiple of `interval` full blocks each step reaches is copied
into a snapshot slot (the worker holds the snapshots' rows, as it holds the state slots),
keyed by the chained hash of the block that ends there: the same key as the KV block, so a
snapshot names the whole token history before it. A new request resumes from the last
snapshot at or before its longest KV hit; it computes from there.

Snapshots are dropped when their block leaves the prefix cache, and otherwise the least
recently used goes first when a new one needs a slot, a request's earlier snapshots before
anyone's latest (a conversation's next turn resumes from its latest). A snapshot planned in a step is not
reused before the step ends (the worker writes it during the step), and one planned in a
step that failed is forgotten (it may never have been written).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagellm.request import BlockHash


class StateSnapshots:
    """Which snapshot slot holds the state after which block (by the block's hash)."""

    def __init__(self, num_slots: int, interval_blocks: int) -> None:
        self.num_slots = num_slots
        self.interval_blocks = interval_blocks
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._planned: dict[BlockHash, int] = {}  # written by the step being scheduled
        # Each request's latest snapshot: when it takes a later one, the earlier goes to the
        # front of the eviction order (a conversation's next turn resumes from its last).
        self._latest_of: dict[str, BlockHash] = {}
        self.num_saved = 0
        self.num_restored = 0

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def num_planned(self) -> int:
        """Snapshots planned in the step being run (written when it ends)."""
        return len(self._planned)

    def resume_point(
        self, hashes: list[BlockHash], num_hit_blocks: int, usable: Callable[[int], bool] = lambda n: True
    ) -> tuple[int, int] | None:
        """(blocks, snapshot slot) of the last snapshot after at most `num_hit_blocks` of
        these blocks whose hit length is `usable` (the KV cache holds what it reads), or
        None. Nothing changes until the caller `claim`s it."""
        for num_blocks in range(num_hit_blocks, 0, -1):
            slot = self._slot_of.get(hashes[num_blocks - 1])
            if slot is not None and usable(num_blocks):
                return num_blocks, slot
        return None

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot of the snapshot after this block (None: none kept)."""
        return self._slot_of.get(block_hash)

    def claim(self, request_id: str, block_hash: BlockHash) -> None:
        """A request resumes from the state after this block: its snapshot (if kept here)
        counts as used, and it is the request's latest."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            self.num_restored += 1
        self._latest_of[request_id] = block_hash

    def plan_saves(
        self, request_id: str, hashes: list[BlockHash], start: int, end: int, block_size: int
    ) -> list[tuple[int, int]]:
        """The snapshot a request computing tokens start .. end - 1 this step writes, as
        [(tokens of the step before it, slot)]: after the last interval-th full block the
        step completes, where none is kept yet ([] if none). Only the last: a conversation's
        next turn resumes from its latest, and one request writing many would evict the
        other conversations' latest. Its earlier snapshot becomes the first to go."""
        span = self.interval_blocks * block_size
        boundary = end // span * span
        if boundary <= start:
            return []
        block_hash = hashes[boundary // block_size - 1]
        earlier = self._latest_of.get(request_id)
        if earlier is not None and earlier != block_hash and earlier in self._slot_of:
            self._slot_of.move_to_end(earlier, last=False)  # (a planned one stays until its step ends)
        self._latest_of[request_id] = block_hash
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return []
        slot = self._take_slot()
        if slot is None:
            return []
        self._slot_of[block_hash] = slot
        self._planned[block_hash] = slot
        self.num_saved += 1
        return [(boundary - start, slot)]

    def forget_request(self, request_id: str) -> None:
        """The request holds no state any more (finished or preempted)."""
        self._latest_of.pop(request_id, None)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slot_of.items():  # the least recently used not being written
            if block_hash not in self._planned:
                del self._slot_of[block_hash]
                return slot
        return None

    def end_step(self, failed: bool = False) -> list[tuple[BlockHash, int]]:
        """The step's snapshots are written (returned, (block hash, slot)), or, when it
        failed, may not be: forgotten."""
        planned, self._planned = self._planned, {}
        if failed:
            for block_hash in planned:
                self.drop(block_hash)
            return []
        return list(planned.items())

    def drop(self, block_hash: BlockHash) -> None:
        """Forget the snapshot after this block (its block left the prefix cache)."""
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self._planned.pop(block_hash, None)
            self._free.append(slot)

    def forget_all(self) -> None:
        """The snapshot slots' contents are gone (the engine sleeps): none is a hit any more."""
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slot_of.clear()
        self._planned.clear()
        self._latest_of.clear()

    def check_integrity(self) -> None:
        owned = list(self._slot_of.values())
        assert sorted(owned + self._free) == list(range(self.num_slots)), "a snapshot slot is lost or held twice"
        assert all(self._slot_of.get(h) == s for h, s in self._planned.items()), "a planned snapshot is not kept"
