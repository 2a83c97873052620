"""Engine stage: async: the one thread that builds an engine and then steps it.

The CPU kernels and torch parallelize with OpenMP, and GNU OpenMP keeps a team of worker
threads for every thread that has ever started a parallel region. Once the process holds
more of those workers than it has cores, every team stops spinning between regions and
sleeps instead, so each of the hundreds of parallel regions in a decode step pays a
futex wake-up: a model loaded on the main thread and stepped on another ran its decode
steps over 2x slower (2 cores: 7.4 ms -> 16 ms per token). Building the engine on the
thread that will step it keeps one team in the process.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class EngineThread(Generic[T]):
    """A daemon thread that runs `build()` at once, then the one job given to `run`.

    `result()` waits for the build and returns what it made (or raises its error). The
    thread ends after the build fails, after its job returns, or when `cancel()` comes
    before a job.
    """

    def __init__(self, build: Callable[[], T], name: str = "pagellm-engine") -> None:
        self._built: Future[T] = Future()
        jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._jobs = jobs
        # The thread does not hold this object: when its owner drops an engine that was
        # never started, the finalizer tells the waiting thread to end, and what it built
        # is freed with the thread's arguments.
        self.thread = threading.Thread(target=_main, args=(build, self._built, jobs), name=name, daemon=True)
        weakref.finalize(self, jobs.put, None)
        self.thread.start()

    def result(self) -> T:
        return self._built.result()

    def run(self, job: Callable[[], None]) -> None:
        """Give the thread its job (the engine loop); call once, after `result()`."""
        self._jobs.put(job)

    def cancel(self) -> None:
        """Let the thread end without a job (the engine was never started)."""
        self._jobs.put(None)


def _main(
    build: Callable[[], T], built: Future[T], jobs: queue.SimpleQueue[Callable[[], None] | None]
) -> None:
    if not _build_into(build, built):
        return
    job = jobs.get()
    if job is not None:
        job()


def _build_into(build: Callable[[], T], built: Future[T]) -> bool:
    try:
        built.set_result(build())
    except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
        built.set_exception(e)
        return False
    return True
