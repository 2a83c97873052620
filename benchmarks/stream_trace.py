"""Timestamps at each hand-off of a streamed token, inside a running server.

    PAGELLM_STREAM_TRACE=trace.json python benchmarks/stream_trace.py serve [serve flags]

runs `pagellm serve` with the hand-offs wrapped (nothing in the library changes): the
engine step starts; the model's output is back (forward pass and sampling done); the
output processor has made the RequestOutputs (detokenized); the step's outputs are handed
to the event loop; the event loop runs the delivery; the request's handler takes its
output from its queue; the SSE chunk is encoded; its bytes are written to the socket.
When the server stops, the events go to the file as {"events": [[name, seconds], ...]}
in time order. `summarize_trace` turns them into per-token stage times.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The stages in the order a token passes them; each is timed from the one before.
STAGES = (
    "step_start",  # the engine thread starts a step (after draining its commands)
    "model_done",  # execute_model returned: forward pass and sampling
    "processed",  # OutputProcessor.process returned: detokenized RequestOutputs
    "handed_off",  # AsyncLLM._flush called: the outputs go to the event loop
    "delivered",  # the event loop runs the step's deliveries
    "taken",  # the request's handler has its output (OutputStream.__anext__)
    "encoded",  # the SSE chunk's JSON is made (sse_event)
    "written",  # the chunk's bytes went to the socket (transport.write)
)


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


def summarize_trace(events: list[tuple[str, float]], min_streams: int = 1) -> dict[str, Any]:
    """Median milliseconds per stage and per token, for the steps that streamed a token.

    A step's engine stages (step_start .. handed_off, delivered) happen once; its per-request
    stages (taken, encoded, written) once per stream: each of those is timed from the step's
    delivery to the request's event, so with N streams the last stream's `written` shows
    how long the whole fan-out took. Only steps that wrote at least `min_streams` chunks
    count (e.g. 32: the steps of a 32-stream run that were not ramping up or down).
    """
    steps: list[dict[str, Any]] = []
    engine_step: dict[str, Any] | None = None  # the step the engine thread is in
    loop_step: dict[str, Any] | None = None  # the step whose outputs the event loop handles
    handed_off: list[dict[str, Any]] = []  # handed to the loop, not delivered yet
    for name, t in events:
        if name == "step_start":
            engine_step = {"step_start": t, "per_request": []}
            steps.append(engine_step)
        elif name in ("model_done", "processed", "handed_off"):
            if engine_step is not None and name not in engine_step:
                engine_step[name] = t
                if name == "handed_off":
                    handed_off.append(engine_step)
        elif name == "delivered":
            if handed_off:
                loop_step = handed_off.pop(0)
                loop_step["delivered"] = t
        elif loop_step is not None:  # taken, encoded, written: one per stream
            loop_step["per_request"].append((name, t))
    stage_ms: dict[str, list[float]] = {s: [] for s in STAGES[1:5]}
    fan_out_ms: dict[str, list[float]] = {"first_written": [], "last_written": []}
    gap_ms: list[float] = []  # from one step's hand-off to the next step's start
    step_ms: list[float] = []
    for step, following in zip(steps, steps[1:] + [None]):
        if not all(s in step for s in STAGES[1:5]):
            continue
        written = [t for name, t in step["per_request"] if name == "written"]
        if len(written) < min_streams:
            continue
        for before, after in zip(STAGES[:4], STAGES[1:5]):
            stage_ms[after].append(1000 * (step[after] - step[before]))
        if written:
            fan_out_ms["first_written"].append(1000 * (written[0] - step["delivered"]))
            fan_out_ms["last_written"].append(1000 * (written[-1] - step["delivered"]))
        step_ms.append(1000 * (step["handed_off"] - step["step_start"]))
        if following is not None:
            gap_ms.append(1000 * (following["step_start"] - step["handed_off"]))

    def med(values: list[float]) -> float | None:
        return round(median(values), 3) if values else None

    return {
        "num_steps": len(step_ms),
        "stage_ms_median": {k: med(v) for k, v in stage_ms.items()},
        "fan_out_ms_median": {k: med(v) for k, v in fan_out_ms.items()},
        "engine_step_ms_median": med(step_ms),
        "between_steps_ms_median": med(gap_ms),
    }


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

