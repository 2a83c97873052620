"""Core stage: a hybrid model's recurrent-state slots (one per request that holds blocks).

A linear-attention layer keeps, per request, a fixed-size state instead of a K/V per
token. The worker holds those states in `num_slots` rows; this pool says which request
owns which row. A request takes a slot when it is admitted and gives it back when it
finishes or is preempted (its state is then recomputed with its tokens); a forked
completion (n > 1) takes its own slot and starts from a copy of its parent's state.
"""

from __future__ import annotations


class StateSlots:
    """Which request owns each recurrent-state slot (none at all for a model without
    linear-attention layers: `num_slots` 0)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Lowest first, so that a light load keeps touching the same few rows.
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    def holders_of(self, slots: list[int]) -> list[str]:
        """The requests owning these slots (a slot freed since has none)."""
        wanted = set(slots)
        return [request_id for request_id, slot in self._slot_of.items() if slot in wanted]

    def allocate(self, request_id: str) -> int:
        """A free slot for the request (which holds none); the caller checked num_free."""
        assert request_id not in self._slot_of, f"{request_id} already holds state slot {self._slot_of[request_id]}"
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's own slot, filled with a copy of the parent's state (queued for the
        worker: take_pending_copies)."""
        assert self._free, "a fork's seat was reserved, so its slot is free"
        self._pending_copies.append((self._slot_of[parent_id], self.allocate(child_id)))

    def free(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            # A copy into a slot freed before the worker made it is dropped with it.
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies if dst != slot]
            self._free.append(slot)

    def awaits_copy(self, request_id: str) -> bool:
        """Whether the request's slot is still to be filled by a fork's copy this step."""
        slot = self._slot_of.get(request_id)
        return slot is not None and any(dst == slot for _, dst in self._pending_copies)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source, target) slot copies decided since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_integrity(self, holders: set[str]) -> None:
        """Every request holding device blocks holds one slot, no one else holds any, and
        every slot is owned or free exactly once."""
        assert set(self._slot_of) == holders, (
            f"state slots held by {sorted(self._slot_of)} but device blocks by {sorted(holders)}"
        )
        owned = list(self._slot_of.values())
        assert sorted(owned + self._free) == list(range(self.num_slots)), "a state slot is lost or held twice"
