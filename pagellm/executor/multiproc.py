"""Executor stage: the other tensor-parallel ranks as processes on this machine (`mp`).

Processes are spawned (not forked: forking a process that holds CUDA or OpenMP threads
is unsafe), one per rank, with GPU `rank` each on CUDA. Each loads its share of the
model and reports over a pipe (ready, or the error that stopped it) before any rank
joins the process group, so a rank that fails to load is reported at once, with its
error, instead of leaving the others in a rendezvous. A monitor thread then watches
the processes: a rank that exits is reported within moments even while the engine idles.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from multiprocessing.process import BaseProcess

import torch

from pagellm.errors import ConfigError
from pagellm.executor.base import WorkerDiedError
from pagellm.executor.distributed_executor import DistributedExecutor
from pagellm.executor.worker_loop import local_init_method, serve_driver
from pagellm.config.engine_config import EngineConfig
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)

# How long a dead rank's exit may take to show on its process after its sockets closed.
_DEATH_NOTICE_S = 2.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.parallel_config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ConfigError(
                f"tensor_parallel_size={size} needs {size} GPUs on this machine, "
                f"{torch.cuda.device_count()} are visible (for more machines use "
                "--distributed-executor-backend ray)"
            )
        init_method = local_init_method()
        context = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess] = []
        pipes = []
        for rank in range(1, size):
            parent, child = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(config, rank, rank_device(device, rank), init_method, child),
                name=f"pagellm-tp{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._processes.append(process)
            pipes.append(parent)
        try:
            # The driver loads its own share while the others load theirs.
            driver = Worker(config, 0, rank_device(device, 0))
            super().__init__(driver, init_method)
            self._wait_until_loaded(pipes)
            self._connect_driver()
        except BaseException:
            for process in self._processes:
                process.kill()
            self._stop_workers()
            raise
        self._monitor = threading.Thread(target=self._watch, name="pagellm-tp-monitor", daemon=True)
        self._monitor.start()
        logger.info(
            "tensor-parallel workers: %s",
            ", ".join(f"rank {rank} pid {pid}" for rank, pid in enumerate(self.worker_pids, start=1)),
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (rank 0 is this process)."""
        return [process.pid for process in self._processes if process.pid is not None]

    def _wait_until_loaded(self, pipes: list[multiprocessing.connection.Connection]) -> None:
        """Each rank's word (ready, or why not); a rank that dies first closes its pipe."""
        pending = dict(zip(pipes, range(1, len(pipes) + 1), strict=True))
        while pending:
            for pipe in multiprocessing.connection.wait(list(pending)):
                rank = pending.pop(pipe)  # type: ignore[call-overload]
                try:
                    status, detail = pipe.recv()  # type: ignore[union-attr]
                except EOFError:
                    process = self._processes[rank - 1]
                    process.join(timeout=5.0)
                    raise WorkerDiedError(
                        f"tensor-parallel rank {rank} exited with code {process.exitcode} while loading"
                    ) from None
                if status != "ready":
                    raise WorkerDiedError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self._processes])
        if not self._closing.is_set():
            report = self._death_report()
            if report is not None:
                self._fail(report)

    def _death_report(self) -> WorkerDiedError | None:
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while True:
            dead = [(rank, p) for rank, p in enumerate(self._processes, start=1) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not dead:
            return None
        rank, process = dead[0]
        how = f"signal {-process.exitcode}" if (process.exitcode or 0) < 0 else f"code {process.exitcode}"
        return WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {process.pid}) died ({how})")

    def _stop_workers(self) -> None:
        for process in self._processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)


def _worker_main(
    config: EngineConfig,
    rank: int,
    device: torch.device,
    init_method: str,
    pipe: multiprocessing.connection.Connection,
) -> None:
    logging.basicConfig(level=os.environ.get("PAGELLM_WORKER_LOG_LEVEL", "WARNING"))
    try:
        worker = Worker(config, rank, device)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then this rank ends
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    pipe.send(("ready", None))
    pipe.close()
    serve_driver(worker, init_method)
