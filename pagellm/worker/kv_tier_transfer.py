"""Worker stage: moving blocks between the KV cache and the tier's store, off the step.

Writes: at the start of a step the blocks to offload are copied out of the KV cache into
one staging tensor (a memory copy, before anything of the step can reuse those blocks)
and handed to a writer thread, which writes them in order (after the deletions sent
with them). The scheduler bounds how many writes wait (TierIndex.offer_write), so the
queue never grows without bound and a step never waits for the disk.

A host-memory cache (kv_offload_host_bytes; on by default when the KV cache is on a
GPU) keeps the latest blocks written or read in RAM in front of the disk, least recently
used out: a load found there is a memory copy, not a file read and check.

Loads: the blocks to load go to a loader thread that reads and checks each entry and
copies it into its device block while the step's forward pass runs (an entry whose write is
still queued, which the scheduler counts as held, is waited for first) (no request of the
step reads those blocks: their request computes from the next step on). The step waits
for the loads before it returns, so no load is ever in flight across steps.

A hybrid model's snapshots travel the same way: written from their snapshot slot, loaded
into the state slot of the request that resumes from them (no request of the step reads
that slot either).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagellm.attention.linear_attention import LinearLayerState
from pagellm.core.kv_tier import TierReport
from pagellm.worker.kv_tier_store import ENTRY_HEADER, TierEntryError, TierStore
from pagellm.worker.recurrent_state import load_state_rows, state_rows

logger = logging.getLogger(__name__)

_STOP = object()


class HostBlockCache:
    """Blocks' payloads in host memory, least recently used first; the writer's caller and
    the loader thread share it."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self._lock = threading.Lock()

    def put(self, digest: bytes, row: torch.Tensor) -> None:
        if row.numel() > self.capacity_bytes:
            return
        with self._lock:
            old = self._rows.pop(digest, None)
            if old is not None:
                self.num_bytes -= old.numel()
            self._rows[digest] = row
            self.num_bytes += row.numel()
            while self.num_bytes > self.capacity_bytes:
                _, dropped = self._rows.popitem(last=False)
                self.num_bytes -= dropped.numel()

    def get(self, digest: bytes) -> torch.Tensor | None:
        with self._lock:
            row = self._rows.get(digest)
            if row is not None:
                self._rows.move_to_end(digest)
            return row

    def drop(self, digest: bytes) -> None:
        with self._lock:
            row = self._rows.pop(digest, None)
            if row is not None:
                self.num_bytes -= row.numel()


class LoadResult:
    """What one step's load batch did."""

    def __init__(self) -> None:
        self.failed: list[bytes] = []
        self.num_loaded = 0
        self.num_loaded_states = 0
        self.num_from_host = 0  # of those, found in the host-memory cache
        self.bytes_read = 0  # from the disk
        self.bytes_loaded = 0  # every entry handled, from the disk or the host cache
        self.seconds = 0.0


class KVTierTransfer:
    def __init__(
        self,
        store: TierStore,
        cache_tensors: list[torch.Tensor],
        host_cache_bytes: int = 0,
        states: tuple[LinearLayerState, ...] = (),
        snapshots: tuple[LinearLayerState, ...] = (),
    ) -> None:
        self.store = store
        self.states = states  # a hybrid's state slots (loads go there) and snapshots (written from)
        self.snapshots = snapshots
        self.host = HostBlockCache(host_cache_bytes) if host_cache_bytes > 0 else None
        self.num_host_hits = 0  # loads served from host memory since start
        self.tensors = cache_tensors  # each distinct KV cache tensor once, in layer order
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._written: list[tuple[bytes, int]] = []
        self._queued: set[bytes] = set()  # keys of the writes queued and not yet done
        self._failed_writes: list[bytes] = []
        self._writer = threading.Thread(target=self._write_loop, name="pagellm-kv-tier-writer", daemon=True)
        self._writer.start()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-kv-tier-loader")

    # ----------------------------------------------------------------- writes

    def offload(
        self, blocks: list[tuple[bytes, int]], deletions: list[bytes], snapshots: list[tuple[bytes, int]] = ()
    ) -> None:
        """Queue deletions, then copy `blocks` (digest, device block) and `snapshots` (key,
        snapshot slot) out and queue them."""
        for digest in deletions:
            if self.host is not None:
                self.host.drop(digest)
            self._queue.put(("delete", digest, None))
        if snapshots:
            rows = state_rows(self.snapshots, [slot for _, slot in snapshots])
            for (key, _), row in zip(snapshots, rows, strict=True):
                if self.host is not None:
                    self.host.put(key, row.clone())
                with self._lock:
                    self._queued.add(key)
                self._queue.put(("write_state", key, row))
        if not blocks:
            return
        index = torch.tensor([block_id for _, block_id in blocks], device=self.tensors[0].device)
        # [tensors, 2, n, block_size, heads, dim] -> one row of bytes per block.
        staged = torch.stack([tensor.index_select(1, index) for tensor in self.tensors])
        rows = staged.movedim(2, 0).contiguous().cpu().reshape(len(blocks), -1).view(torch.uint8)
        for (digest, _), row in zip(blocks, rows, strict=True):
            if self.host is not None:
                self.host.put(digest, row.clone())  # its own memory: the batch may go
            with self._lock:
                self._queued.add(digest)
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
                num_bytes = self.store.write(digest, memoryview(row.numpy()), state=kind == "write_state")
            except OSError as error:
                logger.warning("prefix-cache tier: %s of %s failed: %s", kind, digest.hex(), error)
                if kind != "delete":
                    with self._lock:
                        self._failed_writes.append(digest)
                        self._queued.discard(digest)
                continue
            with self._lock:
                self._written.append((digest, num_bytes))
                self._queued.discard(digest)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(("barrier", b"", done))
        done.wait(timeout)

    # ------------------------------------------------------------------ loads

    def start_loads(
        self, loads: list[tuple[bytes, int]], state_loads: list[tuple[bytes, int]] = ()
    ) -> Future[LoadResult] | None:
        """Start loading blocks (digest, device block) and snapshots (key, state slot)."""
        if not loads and not state_loads:
            return None
        return self._loader.submit(self._load, loads, list(state_loads))

    @torch.inference_mode()
    def _load(self, loads: list[tuple[bytes, int]], state_loads: list[tuple[bytes, int]]) -> LoadResult:
        result = LoadResult()
        started = time.perf_counter()
        # The scheduler counts an entry whose write is in flight as held: wait for the
        # writes queued before this load (in order) unless host memory has the entry.
        keys = [key for key, _ in (*loads, *state_loads)]
        with self._lock:
            in_flight = [key for key in keys if key in self._queued]
        if any(self.host is None or self.host.get(key) is None for key in in_flight):
            self.flush()
        if loads:
            self._load_blocks(loads, result)
        if state_loads:
            self._load_states(state_loads, result)
        result.seconds = time.perf_counter() - started
        return result

    def _read_entries(
        self, loads: list[tuple[bytes, int]], result: LoadResult, state: bool
    ) -> tuple[torch.Tensor, list[int]]:
        """Every entry of `loads` (key, target) read and checked into one buffer (a row
        each, from the host cache where it has them); returns the buffer's payloads and the
        targets of the rows that loaded, in order (a failed entry is counted and skipped)."""
        entry_bytes = self.store.state_entry_bytes if state else self.store.entry_bytes
        buffer = torch.empty((len(loads), entry_bytes), dtype=torch.uint8)
        flat = memoryview(buffer.numpy().reshape(-1))
        targets: list[int] = []
        for key, target in loads:
            row = len(targets)
            cached = self.host.get(key) if self.host is not None else None
            if cached is not None:
                buffer[row, ENTRY_HEADER.size :].copy_(cached)
                result.num_from_host += 1
            else:
                try:
                    self.store.read_into(key, flat[row * entry_bytes : (row + 1) * entry_bytes], state=state)
                except TierEntryError as error:
                    instead = "the request's history is looked up again" if state else "the block is computed instead"
                    logger.warning("prefix-cache tier: %s; %s", error, instead)
                    result.failed.append(key)
                    continue
                result.bytes_read += entry_bytes
                if self.host is not None:
                    self.host.put(key, buffer[row, ENTRY_HEADER.size :].clone())
            targets.append(target)
        result.bytes_loaded += len(loads) * entry_bytes
        return buffer[: len(targets), ENTRY_HEADER.size :], targets

    def _load_blocks(self, loads: list[tuple[bytes, int]], result: LoadResult) -> None:
        # Every entry read straight into one buffer, then one copy per cache tensor.
        payloads, loaded_ids = self._read_entries(loads, result, state=False)
        if loaded_ids:
            first = self.tensors[0]
            shape = (len(loaded_ids), len(self.tensors), first.shape[0], *first.shape[2:])
            blocks = payloads.view(first.dtype).view(shape)
            index = torch.tensor(loaded_ids, device=first.device)
            for layer, tensor in enumerate(self.tensors):
                # [n, 2, block_size, heads, dim] -> [2, n, ...]: the blocks along dim 1.
                tensor.index_copy_(1, index, blocks[:, layer].transpose(0, 1).to(tensor.device))
            result.num_loaded = len(loaded_ids)

    def _load_states(self, loads: list[tuple[bytes, int]], result: LoadResult) -> None:
        payloads, loaded_slots = self._read_entries(loads, result, state=True)
        if loaded_slots:
            load_state_rows(self.states, loaded_slots, payloads)
            result.num_loaded_states = len(loaded_slots)

    def report(self, loading: Future[LoadResult] | None) -> TierReport:
        """This step's report: its loads (waited for) and the writes finished since the last."""
        result = loading.result() if loading is not None else LoadResult()
        self.num_host_hits += result.num_from_host
        with self._lock:
            written, self._written = self._written, []
            failed_writes, self._failed_writes = self._failed_writes, []
        return TierReport(
            written, failed_writes, result.failed, result.num_loaded, result.bytes_read, result.seconds,
            result.bytes_loaded, result.num_loaded_states,
        )  # fmt: skip

    def close(self) -> None:
        if not self._writer.is_alive():
            return
        self._queue.put(_STOP)
        self._writer.join(timeout=60)
        self._loader.shutdown(wait=True)


__all__ = ["KVTierTransfer", "LoadResult"]
