"""Executor stage: the driver side of a tensor-parallel model, whatever runs the other ranks.

The driver is rank 0 in this process. Every step it broadcasts the SchedulerOutput
(which carries only what changed: new requests once, new block ids, token counts) and
the tokens it sampled last step over torch.distributed's gloo group, then runs its own
share; the ranks meet again in the model's all-reduces. A rank that dies closes its
sockets, so the driver's next collective fails at once and the engine learns it from a
WorkerDiedError; a monitor (the subclass's) also reports a death while the engine idles.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod

from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.base import Executor, WorkerDiedError
from pagellm.executor.worker_loop import INIT_CACHE, SHUTDOWN, STEP
from pagellm.config.cache import CacheSize
from pagellm.worker.worker import StepMessage, Worker

logger = logging.getLogger(__name__)


class DistributedExecutor(Executor):
    def __init__(self, driver: Worker, init_method: str) -> None:
        super().__init__()
        self.driver = driver
        self._init_method = init_method
        self._last_sampled: dict[str, list[int]] = {}
        self._closing = threading.Event()

    def _connect_driver(self) -> None:
        """Called once every other rank has loaded its share and is joining."""
        self.driver.connect(self._init_method)

    def cache_size(self) -> CacheSize:
        return self._guard(self.driver.cache_size)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        def run() -> None:
            tp = self.driver.tp
            assert tp is not None
            tp.broadcast_from_driver((INIT_CACHE, (num_gpu_blocks, num_cpu_blocks)))
            self.driver.init_cache(num_gpu_blocks, num_cpu_blocks)

        self._guard(run)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        def run() -> ModelRunnerOutput:
            tp = self.driver.tp
            assert tp is not None
            tp.broadcast_from_driver((STEP, StepMessage(scheduler_output, self._last_sampled)))
            output = self.driver.execute_model(scheduler_output)
            self._last_sampled = output.sampled_token_ids
            return output

        return self._guard(run)

    def _guard(self, fn):  # noqa: ANN001, ANN202 - any callable, its own result
        """Run a driver call; a collective that fails because a rank died becomes a
        WorkerDiedError naming the rank (with the monitor's word on it where it has one)."""
        if self.dead_error is not None:
            raise self.dead_error
        if self._closing.is_set():
            raise WorkerDiedError("the engine was shut down: its tensor-parallel workers have stopped")
        try:
            return fn()
        except RuntimeError as e:
            # Once one rank's step fails the ranks are out of step: nothing can run after.
            error = self._death_report() or WorkerDiedError(f"a tensor-parallel step failed: {e}")
            self._fail(error)
            raise error from e

    @abstractmethod
    def _death_report(self) -> WorkerDiedError | None:
        """Which rank is dead and how, if one is (waits a moment for the news)."""

    @abstractmethod
    def _stop_workers(self) -> None: ...

    def shutdown(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        tp = self.driver.tp
        if self.dead_error is None and tp is not None and tp.device_group is not None:
            try:
                tp.broadcast_from_driver((SHUTDOWN, None))
            except RuntimeError:
                logger.debug("a worker was already gone at shutdown")
        self._stop_workers()
        self.driver.close()
