"""Sim stage: timing the real engine step by step, with the batch of each step.

Used by `pagellm calibrate` (to fit a cost model) and benchmarks/validate_sim.py (to run
the same workload for real). Each step's batch is the engine core's
record of it (engine/core.py), read exactly as in the simulator, which runs the same core.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagellm.core.step_batch import StepBatch

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.outputs import RequestOutput


class EngineProbe:
    """Steps an LLMEngine and reports (outputs, batch, seconds) per step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def step(self) -> tuple[list[RequestOutput], StepBatch, float]:
        """One engine.step(), its batch (read by the engine core as the simulator's is:
        after scheduling, before anything advances), and its wall-clock seconds
        (everything engine.step does: schedule, forward, sample, update, detokenize, metrics)."""
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        record = self.engine.last_step
        assert record is not None, "engine.step() ran no step"
        return outputs, record.batch, seconds
