"""Core stage: request queues: the waiting and swapped queues of the scheduler."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

from pagellm.request import Request

SortKey = Callable[[Request], Any]


class RequestQueue:
    """Requests kept sorted by a policy key; the head is served first.

    Under fcfs the key is the arrival order, so a preempted request re-enters at the
    head (every waiting request arrived after it was admitted) and new requests join
    the tail. Under priority the key is (priority, arrival time, arrival order).
    """

    def __init__(self, key: SortKey) -> None:
        self._key = key
        self._items: list[Request] = []

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def add(self, request: Request) -> None:
        # bisect_right keeps insertion order among equal keys (cannot happen with the
        # scheduler's keys, which end in a unique arrival index).
        bisect.insort_right(self._items, request, key=self._key)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        for index, item in enumerate(self._items):
            if item is request:
                del self._items[index]
                return
        raise ValueError(f"{request} is not in the queue")
