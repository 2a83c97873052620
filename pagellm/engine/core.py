"""Engine stage: the one step loop, schedule -> execute -> update, shared by the engine and the simulator.

`EngineCore.step()` asks the scheduler for a step, reads the step's work (its batch)
before anything advances, has the executor run it, and hands the result back to the
scheduler. What the step did comes back as one `StepRecord`. LLMEngine adds output
processing and metrics around it; the simulator runs the same core over a simulated
executor whose clock is the cost model's (sim/simulator.py). Pure Python, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pagellm.core.scheduler import Scheduler
from pagellm.core.scheduler_output import ModelRunnerOutput, RequestProgress, SchedulerOutput
from pagellm.core.step_batch import StepBatch, batch_from_schedule


class StepExecutor(Protocol):
    """What runs a scheduled step: the engine's executor, or a simulated one."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(frozen=True)
class StepRecord:
    """What one step scheduled, computed and produced."""

    scheduler_output: SchedulerOutput
    batch: StepBatch  # the step's work, read before update_from_output advanced anything
    cached_tokens: dict[str, int]  # prefix-cache hits of the requests admitted this step
    runner_output: ModelRunnerOutput | None = None  # None: the step failed
    progress: list[RequestProgress] | None = None  # update_from_output's result
    execute_seconds: float = 0.0  # on the core's clock
    error: Exception | None = None  # what the execution or the update raised

    @property
    def failed(self) -> bool:
        return self.error is not None


class EngineCore:
    """One scheduler and the executor that runs its steps, on a clock (wall time, or a
    simulation's)."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        clock: Callable[[], float] = time.perf_counter,
        reraise: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        # Errors that end the engine rather than the step (a worker died).
        self.reraise = reraise
        self.block_size = scheduler.cache_config.block_size

    def step(self) -> StepRecord:
        """Schedule, execute and update one step. An exception from the execution or the
        update is the record's `error` (the caller ends that step's requests), except the
        `reraise` ones."""
        scheduler = self.scheduler
        scheduler_output = scheduler.schedule()
        batch = batch_from_schedule(scheduler_output, scheduler.requests, self.block_size)
        # Prefix-cache hits are decided when a request is (re)admitted, i.e. sent new.
        cached = {
            new.req_id: scheduler.requests[new.req_id].num_cached_tokens for new in scheduler_output.scheduled_new_reqs
        }
        try:
            start = self.clock()
            runner_output = self.executor.execute_model(scheduler_output)
            execute_seconds = self.clock() - start
            progress = scheduler.update_from_output(scheduler_output, runner_output)
        except self.reraise:
            raise
        except Exception as error:  # noqa: BLE001 - one step's failure is reported, not raised
            return StepRecord(scheduler_output, batch, cached, error=error)
        scheduler.kv_cache_manager.tier_cost.observe_compute(scheduler.last_step_prefill_tokens, execute_seconds)
        return StepRecord(scheduler_output, batch, cached, runner_output, progress, execute_seconds)
