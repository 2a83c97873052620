"""Executor stage: the interface the engine drives its workers through.

The driver (rank 0) always lives in the engine's process: the engine reads its runner
(the model, the KV cache) directly, and it samples. The other ranks of a tensor-parallel
model run wherever the executor puts them and receive every step from the driver.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.errors import InvalidRequestError, PagellmError
from pagellm.config.cache import CacheSize
from pagellm.model.linear_plans import kernel_info
from pagellm.worker.memory_report import memory_by_component, weight_bytes_by_format
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)


class WorkerDiedError(PagellmError):
    """A worker (another rank of the model) has died: the engine cannot run steps any more."""


@dataclass(frozen=True)
class ExecutorReport:
    """What the engine learns of rank 0 once, after its KV cache is allocated (it reads
    nothing of the runner afterwards; per-step counters come in ModelRunnerOutput)."""

    cpu_kernels: dict[str, str] | None = None  # a bf16 CPU model's kernel choice (model/linear_plans.py kernel_info)
    # The prefix cache's disk tier: the entries its store found at start, least recently
    # used first (None: the runner opened no store).
    kv_tier_entries: tuple[tuple[bytes, int], ...] | None = None
    step_paths: tuple[str, ...] = ()  # how its steps may run (worker/step_paths/), first tried first
    memory: tuple[tuple[str, int], ...] = ()  # (component, bytes): worker/memory_report.py
    weight_formats: tuple[tuple[str, int], ...] = ()  # (how held, bytes): "Q4_1 as stored", "bfloat16", ...


class Executor(ABC):
    driver: Worker
    # Whether a step that raised can be forgotten (its requests ended): with one rank,
    # yes; with several, a rank may have run the step the others did not.
    can_recover_from_step_failures = False

    def __init__(self) -> None:
        self.dead_error: WorkerDiedError | None = None
        self._failure_callbacks: list[Callable[[WorkerDiedError], None]] = []

    @property
    def runner(self) -> ModelRunner:
        assert self.driver.runner is not None, "init_cache first"
        return self.driver.runner

    def describe(self) -> ExecutorReport:
        """Rank 0's facts (call after init_cache)."""
        runner = self.runner
        tier = runner.kv_tier
        return ExecutorReport(
            cpu_kernels=kernel_info(runner.model),
            kv_tier_entries=None if tier is None else tuple(tier.store.entries),
            step_paths=tuple(runner.step_paths.names),
            memory=tuple(memory_by_component(runner).items()),
            weight_formats=tuple(weight_bytes_by_format(runner.model).items()),
        )

    @abstractmethod
    def cache_size(self) -> CacheSize:
        """KV blocks every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def sleep(self, level: int) -> None:
        """Free the KV cache (level 1) and the weights (level 2) of every rank."""
        raise InvalidRequestError("sleep is not supported with several ranks (tensor parallelism) yet", "level")

    def wake_up(self) -> None:
        """Load back what sleep freed."""
        raise InvalidRequestError("sleep is not supported with several ranks (tensor parallelism) yet", "level")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; safe to call more than once."""

    def on_failure(self, callback: Callable[[WorkerDiedError], None]) -> None:
        """Call `callback` (from a monitor thread) as soon as a worker is found dead, also
        while the engine is idle."""
        self._failure_callbacks.append(callback)
        if self.dead_error is not None:
            callback(self.dead_error)

    def _fail(self, error: WorkerDiedError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        logger.error("%s", error)
        for callback in self._failure_callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - one bad listener must not hide the failure
                logger.exception("a worker-failure callback failed")


class UniProcExecutor(Executor):
    """One rank, in this process: the default single-device engine."""

    can_recover_from_step_failures = True

    def __init__(self, driver: Worker) -> None:
        super().__init__()
        self.driver = driver

    def cache_size(self) -> CacheSize:
        return self.driver.cache_size()

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.driver.init_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute_model(scheduler_output)

    def sleep(self, level: int) -> None:
        self.driver.sleep(level)

    def wake_up(self) -> None:
        self.driver.wake_up()

    def shutdown(self) -> None:
        self.driver.close_kv_tier()
