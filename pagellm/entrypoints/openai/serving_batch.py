"""Entrypoints stage: HTTP: the Files API (`/v1/files`) and the Batch API (`/v1/batches`).

Files are uploaded as multipart form data (`file`, `purpose`), as the openai client sends
them; a batch names a file of purpose "batch" and one endpoint its lines call. The batch
runner (batch_runner.py) runs the lines as background requests on this server's own
routes, called in-process with the server's API key.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import httpx2 as httpx
from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.entrypoints.openai.batch_runner import BatchProgress, BatchRunner, RouteCall
from pagellm.entrypoints.openai.batch_store import BatchStore, DirectoryLock, default_batch_dir
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.openapi_docs import BATCH, BATCH_CREATE, FILE_CONTENT, FILE_UPLOAD, FILES, add_route_per_method
from pagellm.entrypoints.openai.serving_common import BACKGROUND
from pagellm.entrypoints.openai.protocol_batch import (
    BatchCreateRequest,
    BatchList,
    BatchObject,
    ExpiresAfter,
    FileDeleted,
    FileList,
    FileObject,
    MAX_FILE_LIFETIME_S,
    MIN_FILE_LIFETIME_S,
)

logger = logging.getLogger(__name__)

# OpenAI's purposes; only "batch" files can be a batch's input.
FilePurpose = Literal["batch", "assistants", "fine-tune", "vision", "user_data", "evals"]
FILE_PURPOSES: tuple[str, ...] = get_args(FilePurpose)
MAX_LIST_LIMIT = 100  # a page of GET /v1/files or /v1/batches
SWEEP_INTERVAL_S = 60.0  # expired files' bytes are deleted at most this long after a call finds them


# A data-parallel router's batch runner marks the requests it sends to the replicas with
# this header, carrying a secret the router gave them (so no client can claim the
# background's exemption from the queue limit).
BACKGROUND_HEADER = "x-pagellm-background"
BACKGROUND_TOKEN_ENV = "PAGELLM_BACKGROUND_TOKEN"


class BackgroundHeaderMiddleware:
    """A request that carries the router's background token adds background requests."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        marked = scope["type"] == "http" and any(
            name == BACKGROUND_HEADER.encode() and hmac.compare_digest(value, self.token)
            for name, value in scope.get("headers", ())
        )
        if not marked:
            await self.app(scope, receive, send)
            return
        reset = BACKGROUND.set(True)
        try:
            await self.app(scope, receive, send)
        finally:
            BACKGROUND.reset(reset)


def in_process_call(app: FastAPI, api_key: str | None, extra_headers: dict[str, str] | None = None) -> RouteCall:
    """POST to one of `app`'s routes without a socket: the same checks, limits and answers
    as over HTTP."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagellm-batch", timeout=None)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a log line per batch line
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(extra_headers or {})

    async def call(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        response = await client.post(path, json=body, headers=headers)
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": {"message": response.text, "type": "internal_error"}}
        return response.status_code, payload

    return call


def page(items: list[Any], limit: int | None, after: str | None) -> tuple[list[Any], bool]:
    """The items after the one with id `after` (none if no listed item has it), at most
    `limit` (1..100, default 20)."""
    if limit is not None and not 1 <= limit <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}.", param="limit")
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    size = limit or 20
    return items[:size], len(items) > size


def batch_dir_for(batch_dir: str | Path | None, served_model_name: str) -> Path | None:
    """--batch-dir: a directory, "none" (no Files and Batch API), or by default one per
    served model under pagellm's cache directory."""
    if isinstance(batch_dir, str) and batch_dir.lower() == "none":
        return None
    if batch_dir is not None:
        return Path(batch_dir)
    return default_batch_dir() / re.sub(r"[^A-Za-z0-9._-]+", "_", served_model_name)


class BatchServing:
    """The Files and Batch API over one directory; `unavailable` says why they are off."""

    def __init__(self, root: Path | None, max_file_bytes: int) -> None:
        self.max_file_bytes = max_file_bytes
        self.unavailable: str | None = None
        self._lock: DirectoryLock | None = None
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None
        self._swept_at = float("-inf")
        if root is None:
            self.unavailable = "The Files and Batch API are off on this server (--batch-dir none)."
            return
        try:
            self._lock = DirectoryLock(root)
            self.store = BatchStore(root)
        except BlockingIOError:
            self.unavailable = (
                f"The batch directory {root} is in use by another server; start this one with its own --batch-dir."
            )
        except OSError as e:  # not a directory, not writable, ...
            self.unavailable = f"The batch directory {root} cannot be used ({e.strerror or e}); pass another --batch-dir."
        if self.unavailable is not None:
            logger.warning("%s The Files and Batch API are off.", self.unavailable)

    def progress(self) -> BatchProgress:
        return self.runner.progress() if self.runner is not None else BatchProgress()

    def start(self, call: RouteCall, max_in_flight: int) -> None:
        if self.store is not None:
            self.runner = BatchRunner(self.store, call, max_in_flight)
            self._sweep_expired()  # what expired while the server was down
            self.runner.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _ready(self) -> tuple[BatchStore, BatchRunner]:
        """The store and runner (expired files swept at most once a minute)."""
        if self.store is None or self.runner is None:
            raise APIError(503, self.unavailable or "The batch runner has not started.", code="batch_api_unavailable")
        if time.monotonic() - self._swept_at >= SWEEP_INTERVAL_S:
            self._sweep_expired()
        return self.store, self.runner

    def _sweep_expired(self) -> None:
        """Delete the expired files' bytes. The API stops showing a file at its expires_at
        either way (the store checks it on every read), so this only reclaims the disk, and
        need not read every file and batch on each status poll."""
        assert self.store is not None and self.runner is not None
        self.store.sweep_expired(keep=self.runner.running_inputs())
        self._swept_at = time.monotonic()

    # ---------------------------------------------------------------- files

    def upload(
        self, content: bytes, filename: str | None, purpose: str, anchor: str | None = None, seconds: int | None = None
    ) -> FileObject:
        """A new file; `anchor` and `seconds` are OpenAI's `expires_after` (form fields
        expires_after[anchor], expires_after[seconds]): seconds alone takes the only anchor
        there is (created_at); an anchor alone says no lifetime and is refused, as the
        schema says (dependentRequired)."""
        store, _ = self._ready()
        lifetime = None
        if seconds is not None and anchor is None:
            anchor = "created_at"
        if anchor is not None or seconds is not None:
            try:
                lifetime = ExpiresAfter(anchor=anchor, seconds=seconds).seconds  # type: ignore[arg-type]
            except ValidationError:
                raise APIError(
                    400, f"expires_after needs anchor 'created_at' and seconds from {MIN_FILE_LIFETIME_S} to "
                    f"{MAX_FILE_LIFETIME_S}; got anchor {anchor!r}, seconds {seconds!r}.", param="expires_after",
                ) from None  # fmt: skip
        if purpose not in FILE_PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}; got {purpose!r}.", param="purpose")
        if len(content) > self.max_file_bytes:
            raise APIError(413, f"The file has {len(content)} bytes; at most {self.max_file_bytes} (--max-batch-file-bytes).", param="file")
        if purpose == "batch":
            try:
                content.decode("utf-8")
            except UnicodeDecodeError:
                raise APIError(400, "A batch input file must be UTF-8 JSONL.", param="file") from None
        return store.add_file(content, filename or "upload.jsonl", purpose, lifetime)

    def list_files(self, purpose: str | None, limit: int | None, after: str | None, order: str) -> FileList:
        store, _ = self._ready()
        files = [f for f in store.files() if purpose is None or f.purpose == purpose]
        if order == "asc":
            files.reverse()
        data, more = page(files, limit, after)
        return FileList(data=data, has_more=more, first_id=data[0].id if data else None, last_id=data[-1].id if data else None)

    def file(self, file_id: str) -> FileObject:
        store, _ = self._ready()
        return store.file(file_id)

    def content(self, file_id: str) -> Response:
        store, _ = self._ready()
        path = store.file_path(file_id)
        return Response(path.read_bytes(), media_type="application/octet-stream")

    def delete_file(self, file_id: str) -> FileDeleted:
        store, _ = self._ready()
        store.file(file_id)
        for batch in store.batches():
            if batch.input_file_id == file_id and batch.status in ("validating", "in_progress", "finalizing", "cancelling"):
                raise APIError(409, f"File {file_id} is the input of batch {batch.id}, which is still running.", param="file_id")
        store.delete_file(file_id)
        return FileDeleted(id=file_id)

    # -------------------------------------------------------------- batches

    def create(self, body: BatchCreateRequest) -> BatchObject:
        _, runner = self._ready()
        return runner.create(body)

    def retrieve(self, batch_id: str) -> BatchObject:
        _, runner = self._ready()
        return runner.get(batch_id)

    def cancel(self, batch_id: str) -> BatchObject:
        _, runner = self._ready()
        return runner.cancel(batch_id)

    def list_batches(self, limit: int | None, after: str | None) -> BatchList:
        store, runner = self._ready()
        batches = [runner.get(b.id) for b in store.batches()]
        data, more = page(batches, limit, after)
        return BatchList(data=data, has_more=more, first_id=data[0].id if data else None, last_id=data[-1].id if data else None)


def add_batch_routes(app: FastAPI, batches: BatchServing) -> None:
    @app.post("/v1/files", responses=FILE_UPLOAD)
    async def upload_file(
        file: Annotated[UploadFile, File(description="The file; for purpose batch, JSONL (one request per line).")],
        purpose: Annotated[FilePurpose, Form(description="batch (a batch's input), or another of OpenAI's purposes.")],
        # Optional but not nullable: a form field has no null (absent means none).
        expires_after_anchor: Annotated[
            Literal["created_at"], Form(alias="expires_after[anchor]", description="created_at: the file expires `seconds` after its creation.")
        ] = None,  # type: ignore[assignment]
        expires_after_seconds: Annotated[
            int, Form(alias="expires_after[seconds]", ge=MIN_FILE_LIFETIME_S, le=MAX_FILE_LIFETIME_S,
                      description="The file's lifetime; then it is deleted (default: kept until deleted).")
        ] = None,  # type: ignore[assignment]  # fmt: skip
    ) -> FileObject:
        return batches.upload(await file.read(), file.filename, purpose, expires_after_anchor, expires_after_seconds)

    @app.get("/v1/files", responses=FILES)
    async def list_files(
        purpose: str | None = None,
        limit: Annotated[int | None, Query(ge=1, le=MAX_LIST_LIMIT)] = None,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> FileList:
        return batches.list_files(purpose, limit, after, order)

    async def file_by_id(file_id: str, raw: Request) -> FileObject | FileDeleted:
        return batches.delete_file(file_id) if raw.method == "DELETE" else batches.file(file_id)

    # One route for both methods, so that a 405 on the path names both in `Allow`; each
    # method its own operation in the schema.
    add_route_per_method(app, "/v1/files/{file_id}", file_by_id, ["DELETE", "GET"], responses=FILES)

    @app.get("/v1/files/{file_id}/content", responses=FILE_CONTENT)
    async def file_content(file_id: str) -> Response:
        return batches.content(file_id)

    @app.post("/v1/batches", responses=BATCH_CREATE)
    async def create_batch(body: BatchCreateRequest) -> BatchObject:
        return batches.create(body)

    @app.get("/v1/batches", responses=BATCH)
    async def list_batches(
        limit: Annotated[int | None, Query(ge=1, le=MAX_LIST_LIMIT)] = None, after: str | None = None
    ) -> BatchList:
        return batches.list_batches(limit, after)

    @app.get("/v1/batches/{batch_id}", responses=BATCH)
    async def retrieve_batch(batch_id: str) -> BatchObject:
        return batches.retrieve(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", responses=BATCH)
    async def cancel_batch(batch_id: str) -> BatchObject:
        return batches.cancel(batch_id)
