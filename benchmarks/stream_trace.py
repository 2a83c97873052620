"""Timestamps at each hand-off of a streamed token, inside a running server.

    PAGELLM_STREAM_TRACE=trace.json python benchmarks/stream_trace.py serve [serve flags]

runs `pagellm serve` with the hand-offs wrapped (nothing in the library changes): the
engine step starts; the model's output is back (forward pass and sampling done); the
output processor has made the RequestOutputs (detokenized); the step's outputs are handed
to the event loop; the event loop runs the delivery; the request's handler takes its
output from its queue; the SSE chunk is encoded; its bytes are written to the socket.
When the server stops, the events go to the file as {"events": [[name, seconds], ...]}
in time order. `summarize_trace` (pagellm/bench/stream_trace.py, whose STAGES are the
names used here) turns them into per-token stage times.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from typing import Any


def _wrap(owner: Any, name: str, before: str | None, after: str | None, events: list) -> None:
    original = getattr(owner, name)
    clock = time.perf_counter

    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            if before:
                events.append((before, clock()))
            result = await original(*args, **kwargs)
            if after:
                events.append((after, clock()))
            return result

        setattr(owner, name, wrapped_async)
        return

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            events.append((before, clock()))
        result = original(*args, **kwargs)
        if after:
            events.append((after, clock()))
        return result

    setattr(owner, name, wrapped)


def install(events: list) -> None:
    """Wrap the hand-offs; `events` collects (stage, perf_counter seconds)."""
    import asyncio.selector_events as selector_events

    from pagellm.engine import async_llm, llm_engine, output_processor
    from pagellm.entrypoints.openai import serving_chat, serving_completion

    _wrap(llm_engine.LLMEngine, "step", "step_start", None, events)
    _wrap(output_processor.OutputProcessor, "process", "model_done", "processed", events)
    _wrap(async_llm.AsyncLLM, "_flush", "handed_off", None, events)
    _wrap(async_llm, "_run_all", "delivered", None, events)
    _wrap(async_llm.OutputStream, "__anext__", None, "taken", events)
    for module in (serving_completion, serving_chat):
        _wrap(module, "sse_event", None, "encoded", events)
    _wrap(selector_events._SelectorSocketTransport, "write", None, "written", events)


def main(argv: list[str]) -> None:
    path = os.environ.get("PAGELLM_STREAM_TRACE")
    if not path:
        raise SystemExit("set PAGELLM_STREAM_TRACE to the file the events go to")
    events: list[tuple[str, float]] = []
    install(events)
    from pagellm.entrypoints.cli import main as cli_main

    try:
        raise SystemExit(cli_main(argv))
    finally:
        with open(path, "w") as f:
            json.dump({"events": events}, f)


if __name__ == "__main__":
    main(sys.argv[1:])

