"""Bench stage: a streamed token's hand-offs inside a server, from the timestamps that
benchmarks/stream_trace.py records, as per-token stage times.

The events are (stage, seconds) pairs in time order, one per hand-off (STAGES); the
script that records them wraps the engine's and the server's functions, so it stays a
script (bench/ does not import entrypoints/); reading them back is plain arithmetic.
"""

from __future__ import annotations

from statistics import median
from typing import Any

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
