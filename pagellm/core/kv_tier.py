"""Core stage: the prefix cache's second tier, as the scheduler sees it.

Full prefix-cache blocks are written through to a second tier (files on local disk, see
worker/kv_tier_store.py) once computed; a prefix lookup that misses the device cache
continues there, and the blocks found are loaded back into fresh device blocks. The
scheduler owns the tier's index (which entries exist, least recently used first, their
bytes) and decides every write, load and deletion; the runner only carries them out
and reports back (ModelRunnerOutput.kv_tier). So the index is exact without the
scheduler ever waiting on I/O, and it is testable without torch.

An entry is keyed by a 16-byte chained digest of the block's tokens (BLAKE2b of the
parent's digest and the token ids), not by the in-process BlockHash: the digest is the
same in every process, so a restarted engine finds its entries again. Blocks computed
under a LoRA adapter never enter the tier (adapter ids are only unique in one process).

A hybrid model (linear-attention layers) also writes its recurrent-state snapshots
(core/state_snapshots.py) to the tier, each under `state_key` of the digest of the block it
follows: a conversation resumes after a restart from the stored state and the KV before
it, without recomputing its history.

Cost rule: loading is worth it only while it takes less time than computing the tokens
it saves. The runner measures each load batch (seconds per byte read and checked) and
the engine each step's prefill rate (seconds per prompt token computed); TierCostModel
keeps a moving average of both and the lookup stops using the tier while reading what a
hit needs is measured slower than computing the tokens it saves (a block's KV saves its
block_size tokens; a hybrid's snapshot saves the whole history before it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from pagellm.request import BlockHash

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
ROOT_DIGEST = bytes(DIGEST_BYTES)
STATE_KEY_PERSON = b"pagellm-state"


def block_digest(block_hash: BlockHash) -> bytes:
    """The chained digest of a block (and so of its whole prefix), cached on the key.

    Iterative: the first call on a long chain walks up to the first node that has one.
    """
    chain: list[BlockHash] = []
    node: BlockHash | None = block_hash
    while node is not None and node.digest is None:
        chain.append(node)
        node = node.parent
    digest = ROOT_DIGEST if node is None else node.digest
    assert digest is not None
    for node in reversed(chain):
        hasher = hashlib.blake2b(digest, digest_size=DIGEST_BYTES)
        for token_id in node.token_ids:
            hasher.update(token_id.to_bytes(8, "little", signed=True))
        digest = hasher.digest()
        node.digest = digest
    return digest


GROUP_KEY_PERSON = b"pagellm-group"


def group_key(digest: bytes, group: int) -> bytes:
    """The tier key of a block's K/V in KV cache group `group` (sliding and global layers:
    config/kv_layout.py): the block's digest for the first group, as for a model of one
    group, a digest of it and the group for the others."""
    if group == 0:
        return digest
    return hashlib.blake2b(digest + group.to_bytes(2, "little"), digest_size=DIGEST_BYTES, person=GROUP_KEY_PERSON).digest()


def state_key(digest: bytes) -> bytes:
    """The tier key of the recurrent-state snapshot after the block of `digest` (never
    equal to a block's digest, so both kinds share one index)."""
    return hashlib.blake2b(digest, digest_size=DIGEST_BYTES, person=STATE_KEY_PERSON).digest()


@dataclasses.dataclass
class TierStats:
    """Cumulative counters since the engine started (blocks unless said)."""

    num_hit_blocks: int = 0  # looked up after a device miss, found in the tier (and loaded)
    num_miss_blocks: int = 0  # looked up after a device miss, in neither
    num_skipped_blocks: int = 0  # found, but not loaded: the cost rule said computing is faster
    num_loaded_blocks: int = 0  # loaded and verified
    num_failed_loads: int = 0  # missing, truncated or corrupt when read: computed instead
    num_written_blocks: int = 0
    num_written_states: int = 0  # a hybrid's snapshots written (beside the blocks)
    num_dropped_writes: int = 0  # the write queue was full: the block was not offloaded
    num_failed_writes: int = 0
    num_evicted_blocks: int = 0  # removed to keep the tier within its size bound
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # summed wall time of the load batches
    num_load_batches: int = 0
    num_loaded_states: int = 0  # a hybrid's snapshots loaded and verified (beside the blocks)


class TierReport(NamedTuple):
    """What the runner did for the tier in one step (ModelRunnerOutput.kv_tier)."""

    written: list[tuple[bytes, int]]  # (key, bytes on disk) of writes finished since the last report
    failed_writes: list[bytes]
    failed_loads: list[bytes]  # of this step's loads (blocks or states); every other one succeeded
    num_loaded: int  # blocks
    bytes_read: int  # from the disk
    load_seconds: float  # wall time of this step's load batch (0.0 without loads)
    bytes_loaded: int = 0  # every entry the batch handled, from the disk or the host cache
    num_loaded_states: int = 0


class TierCostModel:
    """Moving averages of the read time of a byte of the tier and a prompt token's compute time.

    Loading pays while reading what a hit needs is faster than computing the tokens it
    saves. While it does not, one lookup in `probe_every` loads anyway, so the read time
    keeps being measured: one slow read (a cold disk cache, a busy disk) never turns the
    tier off for good."""

    def __init__(self, block_size: int, smoothing: float = 0.2, probe_every: int = 16) -> None:
        self.block_size = block_size
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.read_seconds_per_byte: float | None = None
        self.compute_seconds_per_token: float | None = None
        self._loading_pays: bool | None = None  # the last verdict logged
        self._num_skipped = 0  # lookups computed instead since the last probe

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.read_seconds_per_byte = self._average(self.read_seconds_per_byte, seconds / num_bytes)

    def observe_compute(self, num_prompt_tokens: int, seconds: float) -> None:
        """A step that computed `num_prompt_tokens` prompt positions in `seconds`; steps of
        a few tokens (decodes) say little about prefill and are skipped."""
        if num_prompt_tokens >= self.block_size and seconds > 0:
            self.compute_seconds_per_token = self._average(self.compute_seconds_per_token, seconds / num_prompt_tokens)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def loading_pays(self, num_bytes: int, num_tokens: int) -> bool:
        """Whether to load a lookup's tier hit (`num_bytes` to read, saving the compute of
        `num_tokens`): True until both times were measured, then while reading is faster,
        and for every `probe_every`-th lookup otherwise."""
        read, compute = self.read_seconds_per_byte, self.compute_seconds_per_token
        pays = read is None or compute is None or read * num_bytes < compute * num_tokens
        if pays != self._loading_pays and read is not None and compute is not None:
            logger.info(
                "prefix-cache tier: reading %d bytes takes %.3f ms, computing the %d tokens they hold %.3f ms: %s",
                num_bytes, read * num_bytes * 1e3, num_tokens, compute * num_tokens * 1e3,
                "loading hits from the tier" if pays else
                f"computing instead of loading (the tier is slower; one lookup in {self.probe_every} still loads)",
            )  # fmt: skip
        self._loading_pays = pays
        if pays:
            self._num_skipped = 0
            return True
        self._num_skipped += 1
        if self._num_skipped >= self.probe_every:
            self._num_skipped = 0
            return True
        return False


class TierIndex:
    """The tier's entries (least recently used first), its size bound and its writes in flight."""

    def __init__(self, capacity_bytes: int, max_pending_writes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the tier needs a positive size bound, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.max_pending_writes = max_pending_writes
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # digest -> bytes on disk
        self.num_bytes = 0
        self.pending_writes: set[bytes] = set()
        self._last_entry_bytes = 0
        self._pending_states: set[bytes] = set()  # the snapshots among them
        self._deletions: list[bytes] = []  # decided, not yet sent to the runner
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def holds(self, digest: bytes) -> bool:
        """Whether a block's entry can be loaded: written, or its write in flight (the
        runner's loader waits for a write it has queued before reading that entry, so a
        conversation that comes back while its blocks are being written still finds them)."""
        return digest in self._entries or (digest in self.pending_writes and digest not in self._pending_states)

    def entry_bytes(self, digest: bytes) -> int:
        """Bytes on disk of an entry the tier holds (one in flight: the size of the last
        entry written, which is every block's size for one model; 0 before the first)."""
        return self._entries.get(digest, self._last_entry_bytes)

    def seed(self, entries: Iterable[tuple[bytes, int]]) -> None:
        """Entries found on disk at start, least recently used first."""
        for digest, num_bytes in entries:
            self._add(digest, num_bytes)
        self._evict_over_capacity()

    def touch(self, digests: Iterable[bytes]) -> None:
        """Mark entries as just used (a hit): evicted last."""
        for digest in digests:
            if digest in self._entries:
                self._entries.move_to_end(digest)

    def offer_write(self, digest: bytes, state: bool = False) -> bool:
        """Whether a newly cached block (or a snapshot: `state`) should be written: not in
        the tier yet and room in the write queue (a full queue drops it, counted)."""
        if digest in self._entries or digest in self.pending_writes:
            return False
        if len(self.pending_writes) >= self.max_pending_writes:
            self.stats.num_dropped_writes += 1
            return False
        self.pending_writes.add(digest)
        if state:
            self._pending_states.add(digest)
        return True

    def cancel_writes(self, digests: Iterable[bytes]) -> None:
        """Writes the runner never queued (their step failed): the queue must not shrink."""
        for digest in digests:
            self.pending_writes.discard(digest)
            self._pending_states.discard(digest)

    def apply_report(self, report: TierReport) -> None:
        """The runner's news: finished and failed writes, failed loads."""
        stats = self.stats
        for digest, num_bytes in report.written:
            self.pending_writes.discard(digest)
            self._add(digest, num_bytes)
            if digest in self._pending_states:
                self._pending_states.discard(digest)
                stats.num_written_states += 1
            else:
                stats.num_written_blocks += 1
            stats.bytes_written += num_bytes
        for digest in report.failed_writes:
            self.pending_writes.discard(digest)
            self._pending_states.discard(digest)
            stats.num_failed_writes += 1
        for digest in report.failed_loads:
            self.forget(digest)
        stats.num_failed_loads += len(report.failed_loads)
        stats.num_loaded_blocks += report.num_loaded
        stats.num_loaded_states += report.num_loaded_states
        stats.bytes_read += report.bytes_read
        if report.num_loaded or report.num_loaded_states or report.failed_loads:
            stats.load_seconds += report.load_seconds
            stats.num_load_batches += 1
        self._evict_over_capacity()

    def forget(self, digest: bytes) -> None:
        """Drop an entry the runner found unusable (it removed the file)."""
        num_bytes = self._entries.pop(digest, None)
        if num_bytes is not None:
            self.num_bytes -= num_bytes

    def take_deletions(self) -> list[bytes]:
        deletions, self._deletions = self._deletions, []
        return deletions

    def _add(self, digest: bytes, num_bytes: int) -> None:
        old = self._entries.pop(digest, None)
        if old is not None:
            self.num_bytes -= old
        self._entries[digest] = num_bytes
        self.num_bytes += num_bytes
        self._last_entry_bytes = num_bytes

    def _evict_over_capacity(self) -> None:
        while self.num_bytes > self.capacity_bytes and self._entries:
            digest, num_bytes = self._entries.popitem(last=False)
            self.num_bytes -= num_bytes
            self._deletions.append(digest)
            self.stats.num_evicted_blocks += 1

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(self._entries.values()), "the tier's byte count drifted"
        assert self.num_bytes <= self.capacity_bytes, "the tier is over its size bound"
        assert len(self.pending_writes) <= self.max_pending_writes, "more writes in flight than the queue holds"
        assert self._pending_states <= self.pending_writes, "a snapshot write is counted but not in flight"


__all__ = ["DIGEST_BYTES", "TierCostModel", "TierIndex", "TierReport", "TierStats", "block_digest", "state_key"]
