"""Executor stage: the other tensor-parallel ranks as processes on this machine (`mp`).

Each rank is a fresh interpreter running pagellm's own entry point
(`python -P -m pagellm.executor.rank_process`, see that module), never the user's
script: multiprocessing's spawn would re-import the script's `__main__` in every rank,
which fails (or starts engines within engines) without an `if __name__ == "__main__":`
guard. Nothing is forked either (forking a process that holds CUDA or OpenMP threads is
unsafe). On CUDA rank `rank` takes GPU `rank`. Each rank gets its setup over a socket pair,
loads its share of the model and reports on it (ready, or the error that stopped it)
before any rank joins the process group, so a rank that fails to load is reported at
once, with its error, instead of leaving the others in a rendezvous. A monitor thread
then watches the connections, which stay open for each rank's life: a rank that exits is
reported within moments even while the engine idles.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import site
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.errors import ConfigError
from pagellm.executor.base import WorkerDiedError
from pagellm.executor.distributed_executor import DistributedExecutor
from pagellm.executor.worker_loop import local_init_method
from pagellm.config.engine_config import EngineConfig
from pagellm.structured.grammar_compiler import GrammarCompiler
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)

# How long a dead rank's exit may take to show on its process after its sockets closed.
_DEATH_NOTICE_S = 2.0
_RANK_ENTRY_POINT = "pagellm.executor.rank_process"


@dataclass(frozen=True)
class RankSetup:
    """What a rank's process receives from the driver before it loads anything."""

    config: EngineConfig
    rank: int
    device: torch.device
    init_method: str  # the process group's rendezvous address


@dataclass(frozen=True)
class RankLoaded:
    """A rank's word once it has tried to load its share: error is None when it is ready."""

    error: str | None = None


@dataclass(frozen=True)
class RankProcess:
    """A started rank: its process and the driver's end of its connection."""

    process: subprocess.Popen[bytes]
    connection: multiprocessing.connection.Connection


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, device: torch.device, grammars: GrammarCompiler | None = None) -> None:
        size = config.parallel_config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ConfigError(
                f"tensor_parallel_size={size} needs {size} GPUs on this machine, "
                f"{torch.cuda.device_count()} are visible (for more machines use "
                "--distributed-executor-backend ray)"
            )
        init_method = local_init_method()
        self._ranks: list[RankProcess] = []  # ranks 1..N-1
        environment = rank_environment()
        try:
            for _ in range(1, size):
                self._ranks.append(start_rank_process(environment))
            for rank, started in enumerate(self._ranks, start=1):
                try:
                    started.connection.send(RankSetup(config, rank, rank_device(device, rank), init_method))
                except OSError:
                    pass  # it has exited already: _wait_until_loaded says how
            # The driver loads its own share while the others load theirs.
            driver = Worker(config, 0, rank_device(device, 0), grammars)
            super().__init__(driver, init_method)
            _running.add(self)
            self._wait_until_loaded()
            self._connect_driver()
        except BaseException:
            for started in self._ranks:
                started.process.kill()
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
        return [started.process.pid for started in self._ranks]

    def _wait_until_loaded(self) -> None:
        """Each rank's word (ready, or why not); a rank that dies first closes its connection."""
        pending = {started.connection: rank for rank, started in enumerate(self._ranks, start=1)}
        while pending:
            for connection in multiprocessing.connection.wait(list(pending)):
                rank = pending.pop(connection)  # type: ignore[call-overload]
                try:
                    loaded = connection.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    process = self._ranks[rank - 1].process
                    _wait(process, 5.0)
                    raise WorkerDiedError(
                        f"tensor-parallel rank {rank} exited with code {process.returncode} while loading"
                    ) from None
                if loaded.error is not None:
                    raise WorkerDiedError(f"tensor-parallel rank {rank} failed to start: {loaded.error}")

    def _watch(self) -> None:
        # A rank sends nothing after it loaded: its connection turns readable only when
        # it ends, with its process.
        multiprocessing.connection.wait([started.connection for started in self._ranks])
        if not self._closing.is_set():
            report = self._death_report()
            if report is not None:
                self._fail(report)

    def _death_report(self) -> WorkerDiedError | None:
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while True:
            dead = [(rank, r.process) for rank, r in enumerate(self._ranks, start=1) if r.process.poll() is not None]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not dead:
            return None
        rank, process = dead[0]
        code = process.returncode
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {process.pid}) died ({how})")

    def _stop_workers(self) -> None:
        for started in self._ranks:
            if not _wait(started.process, 5.0):
                started.process.kill()
                _wait(started.process, 5.0)
        _running.discard(self)

    def _terminate(self) -> None:
        """End the ranks now (SIGTERM), without a word to them: for the interpreter's exit."""
        self._closing.set()
        for started in self._ranks:
            started.process.terminate()
        self._stop_workers()


def rank_environment() -> dict[str, str]:
    """This process's environment for a rank, with the folder this pagellm was imported
    from first on PYTHONPATH unless it is an installed site's folder: a script run from a
    source checkout (or after a sys.path edit) then gets ranks that run this very code,
    not another installed copy, or none."""
    environment = dict(os.environ)
    root = Path(__file__).resolve().parents[2]  # the folder holding pagellm/
    site_folders = {Path(folder).resolve() for folder in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in site_folders:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), environment.get("PYTHONPATH")]))
    return environment


def start_rank_process(environment: dict[str, str]) -> RankProcess:
    """One rank's process, running pagellm's entry point; its setup is still to be sent."""
    driver_end, rank_end = multiprocessing.Pipe(duplex=True)
    # -P: the working directory stays off the rank's sys.path, so a file there named like
    # a module (random.py, queue.py) cannot shadow it.
    command = [sys.executable, "-P", "-m", _RANK_ENTRY_POINT, "--fd", str(rank_end.fileno())]
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=environment, pass_fds=[rank_end.fileno()])
    finally:
        rank_end.close()  # the rank holds its own copy: its exit alone must end the connection
    return RankProcess(process, driver_end)


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the process ended within timeout_s."""
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


# Engines never shut down: their ranks end with the interpreter, as multiprocessing ends
# its daemon processes, instead of outliving it.
_running: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for executor in list(_running):
        executor._terminate()
