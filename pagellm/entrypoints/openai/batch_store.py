"""Entrypoints stage: HTTP: the directory that holds uploaded files and batches
(`--batch-dir`), so that a restarted server finds them and resumes unfinished batches.

    files/<file id>           a file's bytes
    files/<file id>.json      its FileObject: a file exists once this is written
    batches/<batch id>.json   a BatchObject, rewritten at each change of status or counts
    batches/<batch id>.results.jsonl   the results so far, one JSON object per line:
                              {"line": input line number, "output": bool, "record": {...}}

A file with an `expires_at` is gone for the API from that second on (404, not listed) and
its two files are deleted by a later sweep (serving_batch.py: at start, and at a Files or
Batch API call at most once a minute), unless a batch that has not ended reads it: such an
input file is deleted once its batch ends.

Every JSON file is written whole to a temporary name and renamed over the old one, so a
crash leaves the old version or the new, never half of one. The results log is appended
to and flushed line by line; a torn last line (a crash mid-write) is dropped on reading.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol_batch import BatchObject, FileObject


def default_batch_dir() -> Path:
    """Under pagellm's cache directory (PAGELLM_CACHE_DIR, else XDG_CACHE_HOME/pagellm)."""
    root = os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm"
    )
    return Path(root) / "batches"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}" if prefix == "file" else f"{prefix}_{uuid.uuid4().hex[:24]}"


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _valid_id(value: str) -> bool:
    # Ids name files here: nothing that could step outside the directory.
    return bool(value) and len(value) <= 64 and all(c.isalnum() or c in "-_" for c in value)


class BatchStore:
    def __init__(self, root: Path, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.clock = clock  # seconds since the epoch (tests move it to expire files)
        self.files_dir = root / "files"
        self.batches_dir = root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        for stale in [*self.files_dir.glob(".*.tmp"), *self.batches_dir.glob(".*.tmp")]:
            stale.unlink(missing_ok=True)  # a write a crash interrupted

    # ---------------------------------------------------------------- files

    def add_file(self, content: bytes, filename: str, purpose: str, lifetime_s: int | None = None) -> FileObject:
        """Store a file; with `lifetime_s` it expires that many seconds after its creation."""
        created_at = int(self.clock())
        file = FileObject(
            id=new_id("file"), bytes=len(content), created_at=created_at, filename=filename, purpose=purpose,
            expires_at=None if lifetime_s is None else created_at + lifetime_s,
        )  # fmt: skip
        _write_atomic(self.files_dir / file.id, content)
        _write_atomic(self.files_dir / f"{file.id}.json", file.model_dump_json().encode())
        return file

    def file(self, file_id: str, even_expired: bool = False) -> FileObject:
        """A file's object; 404 for an unknown id, or an expired file (unless `even_expired`:
        a running batch still reads its input)."""
        path = self.files_dir / f"{file_id}.json"
        if not _valid_id(file_id) or not path.is_file():
            raise APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")
        file = FileObject.model_validate_json(path.read_bytes())
        if self._expired(file) and not even_expired:
            raise APIError(404, f"No such File object: {file_id} (it expired)", param="file_id", code="file_not_found")
        return file

    def _expired(self, file: FileObject) -> bool:
        return file.expires_at is not None and self.clock() >= file.expires_at

    def file_path(self, file_id: str, even_expired: bool = False) -> Path:
        self.file(file_id, even_expired)
        return self.files_dir / file_id

    def files(self) -> list[FileObject]:
        """Every file that has not expired, newest first."""
        found = [f for f in self._all_files() if not self._expired(f)]
        return sorted(found, key=lambda f: (f.created_at, f.id), reverse=True)

    def _all_files(self) -> list[FileObject]:
        found = []
        for path in self.files_dir.glob("*.json"):
            try:
                found.append(FileObject.model_validate_json(path.read_bytes()))
            except (OSError, ValueError):  # deleted meanwhile (a sweep, a DELETE)
                continue
        return found

    def sweep_expired(self, keep: Collection[str] = ()) -> int:
        """Delete the expired files but those in `keep` (inputs of batches still running);
        the number deleted."""
        expired = [f.id for f in self._all_files() if self._expired(f) and f.id not in keep]
        for file_id in expired:
            self._remove_file(file_id)
        return len(expired)

    def delete_file(self, file_id: str) -> None:
        self.file(file_id)
        self._remove_file(file_id)

    def _remove_file(self, file_id: str) -> None:
        (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)  # first: then the file no longer exists
        (self.files_dir / file_id).unlink(missing_ok=True)

    # -------------------------------------------------------------- batches

    def save_batch(self, batch: BatchObject) -> None:
        with self._lock:
            _write_atomic(self.batches_dir / f"{batch.id}.json", batch.model_dump_json().encode())

    def batch(self, batch_id: str) -> BatchObject:
        path = self.batches_dir / f"{batch_id}.json"
        if not _valid_id(batch_id) or not path.is_file():
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return BatchObject.model_validate_json(path.read_bytes())

    def batches(self) -> list[BatchObject]:
        """Every batch, newest first."""
        found = [BatchObject.model_validate_json(p.read_bytes()) for p in self.batches_dir.glob("batch_*.json")]
        return sorted(found, key=lambda b: (b.created_at, b.id), reverse=True)

    def results_path(self, batch_id: str) -> Path:
        return self.batches_dir / f"{batch_id}.results.jsonl"

    def read_results(self, batch_id: str) -> list[dict[str, Any]]:
        """The results logged so far; a torn last line is cut off the file."""
        path = self.results_path(batch_id)
        if not path.exists():
            return []
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(path, "r+b") as f:
                f.truncate(end)
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class ResultsLog:
    """Appends a batch's results, each flushed before the next line runs."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def append(self, line: int, output: bool, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"line": line, "output": output, "record": record}, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of each non-blank line of a JSONL file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if text.strip():
                yield number, text


class DirectoryLock:
    """One server per batch directory: two runners on one directory would run its batches
    twice. Held (flock) until the process exits or `release`."""

    def __init__(self, root: Path) -> None:
        import fcntl

        root.mkdir(parents=True, exist_ok=True)
        self._file = open(root / "lock", "a+")  # noqa: SIM115 - held for the server's life
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            raise
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        self._file.close()
