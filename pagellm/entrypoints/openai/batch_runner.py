"""Entrypoints stage: HTTP: runs batches: each input line becomes a background request on
the live engine, so batch work fills the capacity interactive traffic leaves and yields to
it at once (the scheduler admits background requests only where others leave room, and
preempts them first).

A line runs through the server's own route, called in-process (no socket), so it is checked,
limited and answered exactly as the same request over HTTP would be; the `BACKGROUND`
context variable marks the engine requests it adds. Batches run one at a time, oldest first,
with a bounded number of lines in flight. Every result is logged as it comes
(batch_store.py), so a restarted server resumes a batch where it stopped; once every line
has a result, the output and error files are written in input order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pagellm.entrypoints.openai.batch_store import BatchStore, ResultsLog, jsonl_lines, new_id
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol_batch import (
    BATCH_ENDPOINTS,
    FINAL_STATUSES,
    BatchCreateRequest,
    BatchError,
    BatchErrors,
    BatchObject,
    BatchRequestCounts,
    BatchUsage,
    result_line,
)
from pagellm.entrypoints.openai.serving_common import BACKGROUND

logger = logging.getLogger(__name__)

MAX_BATCH_LINES = 50_000  # OpenAI's limit per batch
SAVE_INTERVAL_S = 0.5  # the batch object's counts are written at most this often

# (endpoint path, request body) -> (HTTP status, response body)
RouteCall = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any]]]


class LineError(Exception):
    """A line that cannot run: it fails alone, with this code and message."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


def parse_line(text: str, endpoint: str | None) -> tuple[str, dict[str, Any]]:
    """(custom_id, body) of one input line, or LineError naming what is wrong. With no
    `endpoint` a line may call any of the batch endpoints (`pagellm run-batch`)."""
    try:
        line = json.loads(text)
    except ValueError as e:
        raise LineError("invalid_json", f"the line is not JSON: {e}") from None
    if not isinstance(line, dict):
        raise LineError("invalid_request", "a line must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "a line needs a custom_id (a non-empty string)")
    if line.get("method", "POST") != "POST":
        raise LineError("invalid_method", "method must be POST", custom_id)
    url = line.get("url")
    if endpoint is not None and url != endpoint:
        raise LineError("mismatched_url", f"url must be the batch's endpoint {endpoint}, got {url!r}", custom_id)
    if url not in BATCH_ENDPOINTS:
        raise LineError("invalid_url", f"url must be one of {', '.join(BATCH_ENDPOINTS)}, got {url!r}", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object", custom_id)
    if body.get("stream"):
        raise LineError("invalid_request", "stream is not supported in a batch", custom_id)
    return custom_id, body


def _error_record(error: LineError) -> dict[str, Any]:
    return result_line(new_id("batch_req"), error.custom_id, None, None, {"code": error.code, "message": str(error)})


@dataclasses.dataclass(frozen=True)
class BatchProgress:
    """What /metrics reports of the Batch API: lines run since start, by outcome, and the
    batches not yet ended."""

    lines_completed: int = 0
    lines_failed: int = 0
    batches_active: int = 0


class BatchRunner:
    def __init__(self, store: BatchStore, call: RouteCall, max_in_flight: int) -> None:
        self.store = store
        self.call = call
        self.max_in_flight = max_in_flight
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._cancelled: set[str] = set()
        self._in_flight: dict[str, set[asyncio.Task[None]]] = {}
        # The batch being run: its counts are fresher than the stored copy (saved now and then).
        self._live: dict[str, BatchObject] = {}
        self.lines_done = {"completed": 0, "failed": 0}  # since start, for /metrics

    # ------------------------------------------------------------ requests

    def create(self, request: BatchCreateRequest) -> BatchObject:
        file = self.store.file(request.input_file_id)
        if file.purpose != "batch":
            raise APIError(400, f"File {file.id} has purpose {file.purpose!r}, not 'batch'.", param="input_file_id")
        now = int(time.time())
        hours = int(request.completion_window[:-1])
        batch = BatchObject(
            id=new_id("batch"),
            endpoint=request.endpoint,
            input_file_id=file.id,
            completion_window=request.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + hours * 3600,
            metadata=request.metadata,
            output_expires_after=request.output_expires_after,
        )
        self.store.save_batch(batch)
        self._wake.set()
        return batch

    def _unfinished(self) -> list[BatchObject]:
        return [batch for batch in self.store.batches() if batch.status not in FINAL_STATUSES]

    def running_inputs(self) -> set[str]:
        """The input files of the batches that have not ended (an expired one is kept for them)."""
        return {batch.input_file_id for batch in self._unfinished()}

    def progress(self) -> BatchProgress:
        return BatchProgress(self.lines_done["completed"], self.lines_done["failed"], len(self._unfinished()))

    def get(self, batch_id: str) -> BatchObject:
        return self._live.get(batch_id) or self.store.batch(batch_id)

    def cancel(self, batch_id: str) -> BatchObject:
        batch = self.get(batch_id)
        if batch.status in ("cancelling", "cancelled"):
            return batch
        if batch.status in FINAL_STATUSES:
            raise APIError(409, f"Cannot cancel a batch with status {batch.status!r}.", param="batch_id")
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        self.store.save_batch(batch)
        self._cancelled.add(batch_id)
        for task in self._in_flight.get(batch_id, ()):
            task.cancel()
        self._wake.set()
        return batch

    # ------------------------------------------------------------- the loop

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pagellm-batches")

    async def stop(self) -> None:
        """Stop running lines (their results are not logged: a restart runs them again)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        BACKGROUND.set(True)  # every engine request this task (and its line tasks) adds
        while True:
            self._wake.clear()
            pending = [b for b in reversed(self.store.batches()) if b.status not in FINAL_STATUSES]
            for batch in pending:
                try:
                    await self._process(batch)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - one broken batch must not stop the others
                    logger.exception("batch %s failed", batch.id)
                    self._finish(batch, "failed", errors=[BatchError(code="internal_error", message="the batch failed; see the server log")])
            if not pending:
                await self._wake.wait()

    async def _process(self, batch: BatchObject) -> None:
        path = self.store.file_path(batch.input_file_id, even_expired=True)  # kept until the batch ends
        if batch.status == "validating":
            if not self._validate(batch, path):
                return
        results = self.store.read_results(batch.id)
        done = {r["line"] for r in results}
        batch.request_counts = BatchRequestCounts(
            total=batch.request_counts.total,
            completed=sum(1 for r in results if r["output"]),
            failed=sum(1 for r in results if not r["output"]),
        )
        batch.usage = BatchUsage()
        for result in results:
            if result["output"]:
                self._count_answer(batch, result["record"]["response"]["body"])
        log = ResultsLog(self.store.results_path(batch.id))
        tasks: set[asyncio.Task[None]] = set()
        self._in_flight[batch.id] = tasks
        self._live[batch.id] = batch
        last_save = time.monotonic()
        expired = False
        try:
            seen: set[str] = {r["record"]["custom_id"] for r in results if r["record"].get("custom_id")}
            for number, text in jsonl_lines(path):
                if batch.id in self._cancelled or batch.status == "cancelling":
                    break
                if time.time() > (batch.expires_at or float("inf")):
                    expired = True
                    break
                if number in done:
                    continue
                while len(tasks) >= self.max_in_flight:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    if time.monotonic() - last_save > SAVE_INTERVAL_S:
                        self.store.save_batch(batch)
                        last_save = time.monotonic()
                task = asyncio.get_running_loop().create_task(self._run_line(batch, number, text, seen, log))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.wait(tasks)
        finally:
            for task in tasks:
                task.cancel()
            log.close()
            self._in_flight.pop(batch.id, None)
            self._live.pop(batch.id, None)
        if batch.id in self._cancelled or batch.status == "cancelling":
            self._cancelled.discard(batch.id)
            self._finish(batch, "cancelled")
        elif expired:
            self._expire(batch, path)
        else:
            self._finish(batch, "completed")

    def _validate(self, batch: BatchObject, path: Any) -> bool:
        """Count the lines; an empty or oversized file fails the batch (a bad line only
        fails itself, when it runs)."""
        total = sum(1 for _ in jsonl_lines(path))
        if total == 0 or total > MAX_BATCH_LINES:
            message = "the input file has no lines" if total == 0 else f"{total} lines; at most {MAX_BATCH_LINES}"
            self._finish(batch, "failed", errors=[BatchError(code="empty_file" if total == 0 else "too_many_lines", message=message)])
            return False
        batch.status, batch.in_progress_at = "in_progress", int(time.time())
        batch.request_counts = BatchRequestCounts(total=total)
        self.store.save_batch(batch)
        return True

    async def _run_line(self, batch: BatchObject, number: int, text: str, seen: set[str], log: ResultsLog) -> None:
        try:
            custom_id, body = parse_line(text, batch.endpoint)
            if custom_id in seen:
                raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line", custom_id)
            seen.add(custom_id)
        except LineError as e:
            record, output = _error_record(e), False
        else:
            try:
                status, response = await self.call(batch.endpoint, body)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the line fails alone
                logger.exception("batch %s line %d failed", batch.id, number)
                status, response = 500, {"error": {"message": f"the line failed: {e}", "type": "internal_error"}}
            request_id = response.get("id") if isinstance(response, dict) and status == 200 else None
            record = result_line(request_id or new_id("batch_req"), custom_id, status, response, None)
            output = status == 200
        log.append(number, output, record)
        counts = batch.request_counts
        if output:
            self._count_answer(batch, response)
            counts.completed += 1
            self.lines_done["completed"] += 1
        else:
            counts.failed += 1
            self.lines_done["failed"] += 1

    @staticmethod
    def _count_answer(batch: BatchObject, response: Any) -> None:
        batch.usage.add(response)
        if batch.model is None and isinstance(response, dict) and isinstance(response.get("model"), str):
            batch.model = response["model"]

    def _expire(self, batch: BatchObject, path: Any) -> None:
        """Lines not run by the deadline fail as batch_expired."""
        done = {r["line"] for r in self.store.read_results(batch.id)}
        log = ResultsLog(self.store.results_path(batch.id))
        try:
            for number, text in jsonl_lines(path):
                if number not in done:
                    try:
                        custom_id: str | None = parse_line(text, batch.endpoint)[0]
                    except LineError as e:
                        custom_id = e.custom_id
                    error = LineError("batch_expired", "the batch's completion window ended before this line ran", custom_id)
                    log.append(number, False, _error_record(error))
                    batch.request_counts.failed += 1
        finally:
            log.close()
        self._finish(batch, "expired")

    def _finish(self, batch: BatchObject, status: str, errors: list[BatchError] | None = None) -> None:
        """Write the output and error files (input order) and the final status."""
        now = int(time.time())
        if status == "completed":
            batch.status, batch.finalizing_at = "finalizing", now
            self.store.save_batch(batch)
        if status in ("completed", "cancelled", "expired"):
            results = sorted(self.store.read_results(batch.id), key=lambda r: r["line"])
            for output, field, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
                records = [r["record"] for r in results if r["output"] is output]
                if records:
                    content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
                    lifetime = None if batch.output_expires_after is None else batch.output_expires_after.seconds
                    file = self.store.add_file(content, f"{batch.id}_{suffix}.jsonl", f"batch_{suffix}", lifetime)
                    setattr(batch, field, file.id)
        if errors:
            batch.errors = BatchErrors(data=errors)
        batch.status = status  # type: ignore[assignment]
        setattr(batch, f"{status}_at", now)
        self.store.save_batch(batch)
        logger.info("batch %s %s: %s", batch.id, status, batch.request_counts.model_dump())
