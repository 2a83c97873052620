"""Entrypoints stage: HTTP: server-sent events, and noticing a client that went away.

A request whose client disconnects must be aborted at once so that its KV blocks are
freed, streaming or not. Both helpers here listen on the ASGI `receive` channel for
`http.disconnect` while the work runs, and cancel the work when it comes; the work's own
`finally` then aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


# Characters Python's str.splitlines (and line readers built on it, such as httpx's
# aiter_lines) treat as line breaks, which JSON leaves unescaped: a sampled token that
# decodes to one would cut an event in half for such a client. They can only occur
# inside JSON strings, where the \u escape means the same.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_event(json_text: str) -> str:
    return f"data: {json_text.translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that stops its generator when the client leaves.

    Starlette does this itself only for some ASGI spec versions; here it always happens,
    so an abandoned stream never keeps generating, even while no chunk is due (a request
    still waiting in the queue).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        """`on_close` runs however the response ends: a generator cancelled before its
        first step never reaches its own `finally`."""
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        logger.debug("client went away while streaming")
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream_then_stop)
                await _wait_for_disconnect(receive)
                task_group.cancel_scope.cancel()
        finally:
            self._on_close()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Only for handlers that have already read their body: after that, the next message on
    the receive channel can only be the disconnect.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also runs if this handler itself is cancelled (server shutting down).
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    try:
        await work_task  # let its cleanup (aborting the engine requests) run to the end
    except asyncio.CancelledError:
        pass
    raise ClientDisconnected()
