"""Engine stage: async: one engine thread steps the LLMEngine; asyncio callers stream outputs.

The LLMEngine is not thread-safe, so every call into it (add_request, abort_request, step,
get_stats) happens on one dedicated engine thread, the one that built it
(`from_engine_args`; engine_thread.py says why that thread must be the same). Callers on
the asyncio event loop talk to that thread only through a thread-safe command queue (add /
abort / stop); the thread drains the queue between steps, so an abort takes effect within
one step. Outputs travel back in one `loop.call_soon_threadsafe` per step, which feeds each
request group's own asyncio queue. The event loop therefore never waits for a model step, and every request
in flight shares the engine's batch (continuous batching).

If the engine thread dies, every waiting caller gets an EngineDeadError (never a hang),
and so does every later one; `is_alive` says so for health checks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pagellm.config.engine_args import EngineArgs
from pagellm.engine.async_requests import EngineDeadError, EngineOverloadedError, EngineSnapshot, NewRequest, OutputStream
from pagellm.engine.engine_thread import EngineThread
from pagellm.engine.input_processor import PromptInput, TokenizedPrompt
from pagellm.engine.llm_engine import LLMEngine
from pagellm.errors import InvalidRequestError, PagellmError
from pagellm.executor.base import WorkerDiedError
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer.tokenizer import LONG_TEXT_CHARS

logger = logging.getLogger(__name__)


@dataclass
class _AddCommand:
    requests: list[NewRequest]
    stream: OutputStream
    accepted: asyncio.Future[None]


@dataclass
class _QueryCommand:
    """Run `fn(engine)` on the engine thread between steps and hand back its result."""

    fn: Callable[[LLMEngine], Any]
    result: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


@dataclass
class _AbortCommand:
    request_ids: list[str] | None  # None: every request in flight


@dataclass
class _SleepCommand:
    """Sleep at `level` once no request is in flight (0: wake up now); `done` is answered then."""

    level: int
    done: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


@dataclass
class _RejectedCommand:
    """A request refused before it reached the engine: counted in its metrics."""

    reason: str


@dataclass
class _WorkerFailed:
    error: WorkerDiedError


_STOP = object()


class AsyncLLM:
    """An asyncio front to one LLMEngine, stepped by its own thread.

    `max_num_queued_requests` caps the engine's waiting queue: an add that would grow it
    past the cap is refused with EngineOverloadedError, so a burst cannot grow the queue
    without bound. None means no cap.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_num_queued_requests: int | None = None,
        engine_thread: EngineThread[LLMEngine] | None = None,
        sleep_idle_seconds: float | None = None,
        sleep_idle_level: int = 1,
    ) -> None:
        """`engine_thread`: the thread that built `engine`, to step it too (see
        engine_thread.py for why that matters); without one, `start()` makes a thread.
        `sleep_idle_seconds`: after that long without requests the engine sleeps at
        `sleep_idle_level` (LLMEngine.sleep); the next request wakes it."""
        if sleep_idle_level not in (1, 2):
            raise ValueError(f"sleep_idle_level must be 1 or 2, got {sleep_idle_level}")
        self.sleep_idle_seconds = sleep_idle_seconds or None
        self.sleep_idle_level = sleep_idle_level
        if max_num_queued_requests is not None and max_num_queued_requests < 1:
            raise ValueError(
                f"max_num_queued_requests must be at least 1, got {max_num_queued_requests}"
            )
        self.engine = engine
        self.max_num_queued_requests = max_num_queued_requests
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        # Guards _closed_error and every put to _commands, so that no command can slip in
        # after the engine thread has drained the queue for the last time.
        self._lock = threading.Lock()
        self._closed_error: EngineDeadError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine_thread = engine_thread
        # Owned by the engine thread.
        self._streams: dict[str, OutputStream] = {}
        self._last_progress = time.monotonic()  # stalled_for: the last step completed, or work arrived
        self._idle_since = time.monotonic()  # the idle timer's start (sleep_idle_seconds)
        self._pending_sleeps: list[_SleepCommand] = []  # asked for while requests were in flight
        # Commands taken off the queue and not yet applied (answered if the loop dies).
        self._taken: deque[object] = deque()
        self._deliveries: list[Callable[[], None]] = []
        self._snapshot = self._make_snapshot()
        # A worker that dies while the engine idles wakes the engine thread to die too.
        engine.executor.on_failure(self._on_worker_failure)

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, max_num_queued_requests: int | None = None, sleep_idle_seconds: float | None = None,
        sleep_idle_level: int = 1,
    ) -> AsyncLLM:  # fmt: skip
        """Build the engine on the thread that will step it (and wait for it)."""
        engine_thread = EngineThread(lambda: LLMEngine.from_engine_args(args))
        return cls(engine_thread.result(), max_num_queued_requests, engine_thread, sleep_idle_seconds, sleep_idle_level)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs.

        Requests added before (from the same loop) wait in the command queue until then.
        """
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._bind_loop()
        if self._engine_thread is not None:
            self._thread = self._engine_thread.thread
            self._engine_thread.run(self._run)
        else:
            self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the engine thread."""
        with self._lock:
            if self._closed_error is None:
                self._closed_error = EngineDeadError("the server is shutting down")
                self._commands.put(_STOP)
        if self._thread is None and self._engine_thread is not None:
            self._engine_thread.cancel()  # never started: let the builder thread end
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout_s)
                return
        # Stops worker processes (tensor parallelism) and closes the engine's files.
        await asyncio.to_thread(self.engine.close)

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and accepts requests."""
        return (
            self._closed_error is None and self._thread is not None and self._thread.is_alive()
        )

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine no longer serves, or None while it does."""
        if self._closed_error is not None:
            return self._closed_error
        if self._thread is not None and not self._thread.is_alive():
            return EngineDeadError("the engine thread has exited")
        return None

    async def sleep(self, level: int = 1) -> None:
        """Sleep (LLMEngine.sleep) once the requests in flight have finished; returns
        asleep. Requests that come meanwhile, or later, run first and wake it."""
        await self._sleep_command(level)

    async def wake_up(self) -> None:
        await self._sleep_command(0)

    async def _sleep_command(self, level: int) -> None:
        loop = self._bind_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._send(_SleepCommand(level, done, loop))
        await done

    @property
    def sleep_level(self) -> int | None:
        """None awake; 1 or 2 asleep (readable from any thread)."""
        return self.engine.sleep_level

    def stalled_for(self) -> float | None:
        """Seconds since the engine last made progress (a step completed, or work arrived
        at an idle engine) while requests are in flight; None when none are. A health check
        compares it with its limit: a step that never returns shows here, readable from any
        thread."""
        if not self._streams:
            return None
        return time.monotonic() - self._last_progress

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ------------------------------------------------------------------- requests

    async def add_requests(self, requests: Sequence[NewRequest]) -> OutputStream:
        """Add a group of requests at once: all are accepted, or none.

        Raises InvalidRequestError (bad prompt or parameters; `.parameter` names it),
        EngineOverloadedError (queue full) or EngineDeadError (engine stopped).
        """
        loop = self._bind_loop()
        # Output constraints compile here, on a worker thread, so that the engine thread
        # finds them cached: a new schema never stalls the requests running.
        for constraint in {r.params.structured_outputs for r in requests} - {None}:
            await asyncio.to_thread(self.engine.grammars.compile, constraint)
        # Text prompts are encoded here too, for the same reason.
        try:
            requests = [
                replace(r, prompt=TokenizedPrompt(r.prompt, await self.tokenize(r.prompt)))
                if isinstance(r.prompt, str) and r.prompt else r
                for r in requests
            ]  # fmt: skip
        except InvalidRequestError as e:
            self._send(_RejectedCommand(e.parameter or "invalid"))  # counted as the engine counts its own
            raise
        stream = OutputStream(self, [r.request_id for r in requests])
        command = _AddCommand(list(requests), stream, loop.create_future())
        self._send(command)
        try:
            await command.accepted
        except asyncio.CancelledError:
            # The caller went away before the engine thread answered: the add may still
            # happen, so abort it (a no-op for ids the engine does not know).
            self.abort(stream.request_ids)
            raise
        return stream

    async def tokenize(
        self, text: str, add_special_tokens: bool = True, parameter: str = "prompt", within_context: bool = True
    ) -> list[int]:
        """The token ids of `text`, encoded without holding up the event loop or the
        engine thread: a long text on a worker thread (the tokenizer releases the GIL for
        it). With `within_context`, a text sure to exceed the context is refused before it
        is encoded (InvalidRequestError naming `parameter`)."""
        if within_context:
            self.engine.input_processor.check_length(text, parameter)
        if len(text) <= LONG_TEXT_CHARS:  # a thread hop would cost more than the encoding
            return self.engine.tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.engine.tokenizer.encode, text, add_special_tokens)

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the iteration early aborts it."""
        stream = await self.add_requests([NewRequest(request_id, prompt, params, priority)])
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop outputs are delivered to: the first one that uses this engine."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncLLM serves the one event loop that first used it")
        return loop

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ask the engine thread to abort requests; takes effect before its next step."""
        try:
            self._send(_AbortCommand(list(request_ids)))
        except EngineDeadError:
            pass  # nothing runs any more

    async def query(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`fn(engine)` evaluated on the engine thread (engine state is not thread-safe).

        Costs the engine nothing unless called: used by the dashboard's state endpoint.
        """
        loop = self._bind_loop()
        result: asyncio.Future[Any] = loop.create_future()
        self._send(_QueryCommand(fn, result, loop))
        return await result

    def abort_all(self) -> None:
        """Abort every request in flight; each stream ends with finish_reason "abort"."""
        try:
            self._send(_AbortCommand(None))
        except EngineDeadError:
            pass

    def _send(self, command: object) -> None:
        with self._lock:
            if self._closed_error is not None:
                raise self._closed_error
            self._commands.put(command)

    # ------------------------------------------------------- engine thread only

    def _on_worker_failure(self, error: WorkerDiedError) -> None:
        """Called from the executor's monitor thread. The engine is marked dead here and
        now (health checks and new requests see it at once, even if the engine thread is
        stuck in a collective that will never complete, as NCCL's can be); the engine
        thread then fails what is in flight when it wakes."""
        with self._lock:
            if self._closed_error is None:
                self._closed_error = EngineDeadError(str(error))
            self._commands.put(_WorkerFailed(error))

    def _run(self) -> None:
        try:
            self._loop_forever()
        except WorkerDiedError as e:
            logger.error("the engine cannot run any more steps: %s", e)
            self._die(EngineDeadError(str(e)))
        except BaseException as e:  # noqa: BLE001 - any escape means the engine is gone
            logger.exception("the engine loop died")
            self._die(EngineDeadError(f"the engine loop died: {e!r}"))

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            timeout = self._idle_timeout() if idle else None
            commands = self._next_commands(block=idle, timeout=timeout)
            if idle:
                self._last_progress = time.monotonic()  # new work: its first step starts now
                if not commands and timeout is not None:  # idle for sleep_idle_seconds
                    self._sleep_when_idle()
                    continue
            self._taken.extend(commands)
            while self._taken:
                command = self._taken[0]
                if command is _STOP:
                    self._stop()
                    return
                if isinstance(command, _WorkerFailed):
                    raise command.error
                self._apply(command)
                self._taken.popleft()
            if engine.has_unfinished_requests():
                self._route(engine.step())
                self._last_progress = time.monotonic()
                if not engine.has_unfinished_requests():
                    self._idle_since = self._last_progress
            self._sleep_if_asked()
            self._snapshot = self._make_snapshot()
            self._flush()

    def _idle_timeout(self) -> float | None:
        """How long an idle engine waits for a command before the idle timer puts it to sleep."""
        if self.sleep_idle_seconds is None or self.engine.sleep_level is not None:
            return None
        return max(0.0, self._idle_since + self.sleep_idle_seconds - time.monotonic())

    def _sleep_when_idle(self) -> None:
        """The idle timer's sleep. An executor that cannot sleep (several ranks) turns the
        timer off rather than end the engine loop."""
        logger.info("no request for %g s: sleeping", self.sleep_idle_seconds)
        try:
            self.engine.sleep(self.sleep_idle_level)
        except InvalidRequestError as e:
            logger.warning("the idle timer is off: %s", e)
            self.sleep_idle_seconds = None

    def _sleep_if_asked(self) -> None:
        """Sleep for the callers that asked, now that no request is in flight."""
        if not self._pending_sleeps or self.engine.has_unfinished_requests():
            return
        asked, self._pending_sleeps = self._pending_sleeps, []
        error: BaseException | None = None
        try:
            self.engine.sleep(max(command.level for command in asked))
        except Exception as e:  # noqa: BLE001 - the callers get the error, the engine lives on
            error = e
        for command in asked:
            command.loop.call_soon_threadsafe(_set_result, command.done, None, error)

    def _next_commands(self, block: bool, timeout: float | None = None) -> list[object]:
        """Every queued command; when idle, wait for at least one (or `timeout` seconds)."""
        commands: list[object] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: object) -> None:
        if isinstance(command, _AbortCommand):
            request_ids = command.request_ids
            if request_ids is None:
                request_ids = list(self._streams)
            self._route(self.engine.abort_request(request_ids))
        elif isinstance(command, _AddCommand):
            self._add(command)
        elif isinstance(command, _SleepCommand):
            if command.level:
                self._pending_sleeps.append(command)  # asleep once idle: _sleep_if_asked
                return
            error: BaseException | None = None
            try:
                self.engine.wake_up()
            except Exception as e:  # noqa: BLE001
                error = e
            self._idle_since = time.monotonic()
            command.loop.call_soon_threadsafe(_set_result, command.done, None, error)
        elif isinstance(command, _RejectedCommand):
            self.engine.metrics.request_rejected(command.reason)
        elif isinstance(command, _QueryCommand):
            try:
                value, error = command.fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - the caller gets the error, the engine lives on
                value, error = None, e
            command.loop.call_soon_threadsafe(_set_result, command.result, value, error)
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _add(self, command: _AddCommand) -> None:
        limit = self.max_num_queued_requests
        num_waiting = self.engine.scheduler.num_waiting_interactive if limit is not None else 0
        # Counted in sequences (n of them per request), as the scheduler queues them. An
        # empty queue admits any group, so that no group is refused forever. Background
        # work (batch lines, whose runner bounds them itself) neither counts nor is refused.
        num_new = sum(request.params.n for request in command.requests if not request.background)
        if limit is not None and num_new and num_waiting > 0 and num_waiting + num_new > limit:
            self.engine.metrics.request_rejected("overloaded")
            self._reject(
                command,
                EngineOverloadedError(
                    f"The server is overloaded: {num_waiting} requests are already waiting "
                    f"(--max-num-queued-requests={limit}). Retry later.",
                    self._retry_after_s(num_waiting),
                ),
            )
            return
        added: list[str] = []
        try:
            for request in command.requests:
                self.engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.params,
                    arrival_time=request.arrival_time,
                    priority=request.priority,
                    background=request.background,
                    lora_request=request.lora_request,
                )
                added.append(request.request_id)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone, never the engine
            if not isinstance(e, PagellmError):
                logger.exception("adding request %s failed", command.stream.request_ids)
            self.engine.abort_request(added)  # all or none of the group
            self._reject(command, e)
            return
        for request_id in added:
            self._streams[request_id] = command.stream
        self._deliveries.append(functools.partial(_resolve, command.accepted, None))

    def _retry_after_s(self, num_waiting: int) -> int:
        """When a refused request may find room: the waiting ones start as running ones
        finish, max_num_seqs at a time, each taking about the recent mean request time
        (1 to 60 s: the range clients honour; 1 before any request has finished)."""
        mean_s = self.engine.metrics.recent_mean("e2e")
        if mean_s is None:
            return 1
        seats = self.engine.config.scheduler_config.max_num_seqs
        return max(1, min(60, math.ceil(mean_s * num_waiting / seats)))

    def _reject(self, command: _AddCommand, error: BaseException) -> None:
        self._deliveries.append(functools.partial(_resolve, command.accepted, error))

    def _route(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if stream is not None:
                self._deliveries.append(functools.partial(stream._put, output))

    def _flush(self) -> None:
        """Hand this step's deliveries to the event loop in one call."""
        if not self._deliveries:
            return
        batch, self._deliveries = self._deliveries, []
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(_run_all, batch)
        except RuntimeError:
            logger.warning("the event loop is closed; dropping %d engine outputs", len(batch))

    def _stop(self) -> None:
        """Shutdown: abort what is in flight, refuse what was still queued."""
        in_flight = list(self._streams)
        if in_flight:
            logger.info("shutting down: aborting %d requests in flight", len(in_flight))
            self._route(self.engine.abort_request(in_flight))
        self._refuse_queued(self._closed_error or EngineDeadError("the engine has stopped"))
        self._snapshot = self._make_snapshot()
        self._flush()

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._closed_error is None:
                self._closed_error = error
        for stream in set(self._streams.values()):
            self._deliveries.append(functools.partial(stream._put, error))
        self._streams.clear()
        for command in self._pending_sleeps:
            command.loop.call_soon_threadsafe(_set_result, command.done, None, error)
        self._pending_sleeps.clear()
        self._refuse_queued(error)
        self._flush()

    def _refuse_queued(self, error: EngineDeadError) -> None:
        # _closed_error is set, so nothing new is put after this drain. An add that was
        # being applied when the loop died may be answered twice; _resolve keeps the first.
        self._taken.extend(self._next_commands(block=False))
        while self._taken:
            command = self._taken.popleft()
            if isinstance(command, _AddCommand):
                self._reject(command, error)

    def _make_snapshot(self) -> EngineSnapshot:
        manager = self.engine.scheduler.kv_cache_manager
        return EngineSnapshot(
            stats=self.engine.get_stats(),
            num_free_blocks=manager.num_free_blocks,
            num_usable_blocks=manager.num_usable_blocks,
            num_unfinished_requests=self.engine.get_num_unfinished_requests(),
            num_lora_loads=self.engine.metrics.lora_loads,
            num_lora_evictions=self.engine.metrics.lora_evictions,
        )


def _set_result(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return  # the caller was cancelled meanwhile
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()

