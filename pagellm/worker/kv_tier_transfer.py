"""Worker stage: moving blocks between the KV cache and the tier's store, off the step.

Writes: at the start of a step the blocks to offload are copied out of the KV cache into
one staging tensor (a memory copy, before anything of the step can reuse those blocks)
and handed to a writer thread, which writes them in order (after the deletions sent
with them). The scheduler bounds how many writes wait (TierIndex.offer_write), so the
queue never grows without bound and a step never waits for the disk.

Loads: the blocks to load go to a loader thread that reads and checks each entry and
copies it into its device block while the step's forward pass runs (no request of the
step reads those blocks: their request computes from the next step on). The step waits
for the loads before it returns, so no load is ever in flight across steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagellm.core.kv_tier import TierReport
from pagellm.worker.kv_tier_store import ENTRY_HEADER, TierEntryError, TierStore

logger = logging.getLogger(__name__)

_STOP = object()


class LoadResult:
    """What one step's load batch did."""

    def __init__(self) -> None:
        self.failed: list[bytes] = []
        self.num_loaded = 0
        self.bytes_read = 0
        self.seconds = 0.0


class KVTierTransfer:
    def __init__(self, store: TierStore, cache_tensors: list[torch.Tensor]) -> None:
        self.store = store
        self.tensors = cache_tensors  # each distinct KV cache tensor once, in layer order
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._written: list[tuple[bytes, int]] = []
        self._failed_writes: list[bytes] = []
        self._writer = threading.Thread(target=self._write_loop, name="pagellm-kv-tier-writer", daemon=True)
        self._writer.start()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-kv-tier-loader")

    # ----------------------------------------------------------------- writes

    def offload(self, blocks: list[tuple[bytes, int]], deletions: list[bytes]) -> None:
        """Queue deletions, then copy `blocks` (digest, device block) out and queue them."""
        for digest in deletions:
            self._queue.put(("delete", digest, None))
        if not blocks:
            return
        index = torch.tensor([block_id for _, block_id in blocks], device=self.tensors[0].device)
        # [tensors, 2, n, block_size, heads, dim] -> one row of bytes per block.
        staged = torch.stack([tensor.index_select(1, index) for tensor in self.tensors])
        rows = staged.movedim(2, 0).contiguous().cpu().reshape(len(blocks), -1).view(torch.uint8)
        for (digest, _), row in zip(blocks, rows, strict=True):
            self._queue.put(("write", digest, row))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            kind, digest, row = item  # type: ignore[misc]
            if kind == "barrier":
                row.set()
                continue
            try:
                if kind == "delete":
                    self.store.delete(digest)
                    continue
                num_bytes = self.store.write(digest, memoryview(row.numpy()))
            except OSError as error:
                logger.warning("prefix-cache tier: %s of %s failed: %s", kind, digest.hex(), error)
                if kind == "write":
                    with self._lock:
                        self._failed_writes.append(digest)
                continue
            with self._lock:
                self._written.append((digest, num_bytes))

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(("barrier", b"", done))
        done.wait(timeout)

    # ------------------------------------------------------------------ loads

    def start_loads(self, loads: list[tuple[bytes, int]]) -> Future[LoadResult] | None:
        if not loads:
            return None
        return self._loader.submit(self._load, loads)

    @torch.inference_mode()
    def _load(self, loads: list[tuple[bytes, int]]) -> LoadResult:
        result = LoadResult()
        started = time.perf_counter()
        shape = (len(self.tensors), *self.tensors[0].shape[:1], *self.tensors[0].shape[2:])
        dtype = self.tensors[0].dtype
        for digest, block_id in loads:
            try:
                data = self.store.read(digest)
            except TierEntryError as error:
                logger.warning("prefix-cache tier: %s; the block is computed instead", error)
                result.failed.append(digest)
                continue
            payload = torch.frombuffer(data, dtype=torch.uint8)[ENTRY_HEADER.size :]
            block = payload.view(dtype).view(shape)
            for tensor, part in zip(self.tensors, block, strict=True):
                tensor[:, block_id].copy_(part)
            result.num_loaded += 1
            result.bytes_read += len(data)
        result.seconds = time.perf_counter() - started
        return result

    def report(self, loading: Future[LoadResult] | None) -> TierReport:
        """This step's report: its loads (waited for) and the writes finished since the last."""
        result = loading.result() if loading is not None else LoadResult()
        with self._lock:
            written, self._written = self._written, []
            failed_writes, self._failed_writes = self._failed_writes, []
        return TierReport(written, failed_writes, result.failed, result.num_loaded, result.bytes_read, result.seconds)

    def close(self) -> None:
        if not self._writer.is_alive():
            return
        self._queue.put(_STOP)
        self._writer.join(timeout=60)
        self._loader.shutdown(wait=True)


__all__ = ["KVTierTransfer", "LoadResult"]
