"""Core stage: an optional log of every block event, one JSON line each.

Events (all with "step", "time" and "event"):
  allocate       request_id, block_ids          new blocks for a request
  cache_hit      request_id, block_ids          cached blocks reused at admission
  cache          request_id, block_ids          blocks registered in the prefix cache
  evict          block_ids                      cached content dropped (block reused)
  free           request_id, block_ids          a request drops its device references
  swap_out       request_id, block_ids, host_block_ids
  swap_in        request_id, host_block_ids, block_ids
  fork           request_id, parent_id, block_ids   a completion shares its parent's blocks
  copy_on_write  request_id, block_ids=[shared, private]
  preempt        request_id, mode
Replaying them in order (kv_replay.py) rebuilds who holds which block at any step.
Off by default; when off, the hooks cost one `is None` check.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import IO, Any


class KVEventLog:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self.step = 0

    def record(
        self,
        event: str,
        request_id: str | None = None,
        block_ids: Iterable[int] = (),
        **extra: Any,
    ) -> None:
        entry: dict[str, Any] = {"step": self.step, "time": time.time(), "event": event}
        if request_id is not None:
            entry["request_id"] = request_id
        entry["block_ids"] = list(block_ids)
        entry.update(extra)
        self._file.write(json.dumps(entry) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
