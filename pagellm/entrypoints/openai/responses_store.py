"""Entrypoints stage: HTTP: the Responses API's memory: responses kept for GET and for
`previous_response_id`, at most `--max-stored-responses` of them, the oldest evicted first.

Each entry holds the response object as the client sees it and the conversation that
produced it, as chat messages with the response's own output appended, so that a request
naming it as `previous_response_id` continues that conversation. A background response's
entry also holds the task that runs it (cancel stops it).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.openai.protocol_responses import ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # chat messages, this response's output included once done
    tools: list[dict[str, Any]] = field(default_factory=list)  # chat-shaped tools it was offered
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's input, as GET .../input_items lists it
    timings: dict[str, Any] | None = None  # serving_common.timings_of, when asked for
    compare_with: str | None = None  # prompt_cache_options.comparison_response_id
    diagnostics: dict[str, Any] | None = None  # prompt_cache_diagnostics, once finished
    task: asyncio.Task[None] | None = None  # a background response still running


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            if evicted.task is not None:  # a background run nobody can poll any more
                evicted.task.cancel()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None and entry.task is not None:
            entry.task.cancel()
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
