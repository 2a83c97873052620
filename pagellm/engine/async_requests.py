"""Engine stage: async: what AsyncLLM's callers hand in (NewRequest) and get back (an
OutputStream of each group's outputs, an EngineSnapshot of its state), and the errors it
raises. The streams are fed on the event loop thread; engine/async_llm.py runs the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagellm.core.scheduler_stats import SchedulerStats
from pagellm.engine.input_processor import PromptInput
from pagellm.errors import PagellmError, RequestFailedError
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class _Aborter(Protocol):
    def abort(self, request_ids: Sequence[str]) -> None: ...


class EngineDeadError(PagellmError):
    """The engine loop has stopped (crashed or shut down): nothing more can be served."""


class EngineOverloadedError(PagellmError):
    """Too many requests are already waiting; the caller should retry in about
    `retry_after_s` seconds (the server's Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class NewRequest:
    """One request to add: the engine's add_request arguments."""

    request_id: str
    prompt: PromptInput
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request
    priority: int = 0
    arrival_time: float | None = None
    background: bool = False  # a batch line: runs where the others leave room
    lora_request: LoRARequest | None = None  # the adapter it runs under


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest step, readable from any thread."""

    stats: SchedulerStats
    num_free_blocks: int
    num_usable_blocks: int
    num_unfinished_requests: int
    num_lora_loads: int = 0  # LoRA adapters copied into a slot since start
    num_lora_evictions: int = 0  # ... and taken out of their slot for another


class OutputStream:
    """The outputs of a group of requests added together, as the engine makes them.

    Iterate it for RequestOutputs (each group member's last one has finished=True); it
    ends when all have finished. It raises EngineDeadError if the engine dies first, and
    RequestFailedError if an engine step a member was in failed (the others are aborted).
    Call `cancel()` when done early (client gone): unfinished members are aborted.
    """

    def __init__(self, owner: _Aborter, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop thread with what the engine thread sent."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            if item.request_id not in self._unfinished:
                continue  # e.g. an abort echo after cancel()
            if item.error is not None:  # a failed step ended it: the group fails with it
                self._unfinished.discard(item.request_id)
                self.cancel()
                raise RequestFailedError(item.error)
            if item.finished:
                self._unfinished.discard(item.request_id)
            return item
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Abort every member that has not finished; safe to call more than once."""
        if self._unfinished:
            self._owner.abort(list(self._unfinished))
            self._unfinished.clear()
