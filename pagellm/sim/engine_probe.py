"""Sim stage: timing the real engine step by step, with the batch of each step.

Used by `pagellm calibrate` (to fit a cost model) and benchmarks/validate_sim.py (to run
the same workload for real). The probe wraps the scheduler's schedule() on this one
engine instance so that each step's batch is read exactly as the simulator reads it:
after scheduling, before the runner executes and update_from_output advances anything.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagellm.sim.step_batch import StepBatch, batch_from_schedule

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.outputs import RequestOutput


class EngineProbe:
    """Steps an LLMEngine and reports (outputs, batch, seconds) per step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        scheduler = engine.scheduler
        block_size = engine.config.cache_config.block_size
        schedule = scheduler.schedule
        self._batch: StepBatch | None = None

        def schedule_and_record():  # type: ignore[no-untyped-def]
            output = schedule()
            self._batch = batch_from_schedule(output, scheduler.requests, block_size)
            return output

        # An instance attribute shadows the method for this engine only.
        scheduler.schedule = schedule_and_record  # type: ignore[method-assign]

    def step(self) -> tuple[list[RequestOutput], StepBatch, float]:
        """One engine.step(), its batch, and its wall-clock seconds (everything
        engine.step does: schedule, forward, sample, update, detokenize, metrics)."""
        self._batch = None
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        assert self._batch is not None, "engine.step() did not call schedule()"
        return outputs, self._batch, seconds
