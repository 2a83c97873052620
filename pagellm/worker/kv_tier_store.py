"""Worker stage: the prefix cache's second tier on local disk: one file per block.

Layout under the directory the user gives (--kv-offload-path):

    DIR/<identity key>/identity.json     what wrote these entries (TierIdentity)
    DIR/<identity key>/<digest hex>.kv   one block: entry header + K/V bytes, or a hybrid
                                         model's recurrent-state snapshot (keyed by
                                         core/kv_tier.state_key): entry header + state bytes

The identity key is a digest of the identity, so engines of different models, dtypes,
KV cache dtypes, block sizes or formats never read each other's entries (each finds
its own folder, and logs the others it ignores). An entry file is

    magic (8 bytes) | block digest (16) | payload length (u64) | CRC-32 of payload (u32) | 4 zero bytes | payload

and the payload is the block's K and V of every cache tensor, [tensors, 2, block_size,
kv_heads, head_dim] in the KV cache's dtype; a snapshot's (another magic) is, layer by
layer, the conv state then the recurrent state of every linear-attention layer, float32
(worker/recurrent_state.py). Writes go to a temporary file that is
renamed over the entry when complete, so a writer killed mid-write leaves only a
temporary file (removed at the next start), never a partial entry under an entry's
name; a torn or flipped entry (a crash of the machine, a bad disk) fails its length or
CRC check when read, and is removed then, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import zlib
from pathlib import Path

from pagellm.config.engine_config import EngineConfig
from pagellm.errors import ConfigError
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.core.kv_tier import DIGEST_BYTES

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENTRY_MAGIC = b"PGLMKVT1"
STATE_MAGIC = b"PGLMSTT1"
ENTRY_HEADER = struct.Struct("<8s16sQI4x")
ENTRY_SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
IDENTITY_FILE = "identity.json"
# The weights' digest reads this much at the start, the end and every SAMPLE_STRIDE of
# each weight file (not all of it: a 70B checkpoint would take minutes).
SAMPLE_BYTES = 1 << 20
SAMPLE_STRIDE = 64 << 20
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


class TierEntryError(Exception):
    """An entry that is missing, truncated, or fails its checks."""


@dataclasses.dataclass(frozen=True)
class TierIdentity:
    """Everything that must match for a stored block to be valid in this engine."""

    model: str
    weights_digest: str
    dtype: str  # the model's compute dtype (the K/V were computed in it)
    kv_cache_dtype: str
    block_size: int
    num_tensors: int  # cache tensors a block spans (layers of its KV cache group)
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    format_version: int = FORMAT_VERSION
    state_payload_bytes: int = 0  # a hybrid model's snapshot (0: not a hybrid)

    @property
    def payload_bytes(self) -> int:
        return self.num_tensors * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_bytes

    def fields(self) -> dict[str, object]:
        """What identity.json holds (and the key digests): a model without recurrent
        state leaves its 0 out, so its folder is the one it had before snapshots existed."""
        fields = dataclasses.asdict(self)
        if not self.state_payload_bytes:
            del fields["state_payload_bytes"]
        return fields

    @property
    def key(self) -> str:
        text = json.dumps(self.fields(), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def describe(self) -> str:
        return (
            f"{self.model} ({self.dtype}, KV {self.kv_cache_dtype}, block {self.block_size}, "
            f"format {self.format_version})"
        )

    @staticmethod
    def for_engine(config: EngineConfig, element_bytes: int) -> TierIdentity:
        model_config = config.model_config
        layout = kv_cache_layout(model_config)
        # A cache of one head shape names it (Gemma 4's global heads, where every layer is
        # global); several shapes, its tensors' width.
        group = layout.groups[0]
        heads, head_dim = (group.num_kv_heads, group.head_dim) if layout.uniform else (1, layout.tensor_width)
        weights = (
            f"dummy(seed={config.seed})" if config.load_format == "dummy" else weights_digest(config.source.path)
        )
        return TierIdentity(
            model=config.source.name,
            weights_digest=weights,
            dtype=str(config.dtype),
            kv_cache_dtype=str(config.kv_cache_dtype),
            block_size=config.cache_budget.block_size,
            num_tensors=layout.layers_per_block,
            num_kv_heads=heads,
            head_dim=head_dim,
            element_bytes=element_bytes,
            state_payload_bytes=model_config.state_bytes_per_request(),
        )


def weights_digest(path: Path) -> str:
    """A digest of the checkpoint's weight files: names, sizes and sampled contents."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    hasher = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        hasher.update(f"{file.name}:{size}".encode())
        offsets = sorted({*range(0, size, SAMPLE_STRIDE), max(0, size - SAMPLE_BYTES)})
        with open(file, "rb") as handle:
            for offset in offsets:
                handle.seek(offset)
                hasher.update(handle.read(SAMPLE_BYTES))
    return hasher.hexdigest()


def _writer_alive(temp_name: str) -> bool:
    """Whether the process that is writing a temporary file still runs (another replica
    of a data-parallel server shares the directory): `.tmp-<pid>-<n>`."""
    try:
        pid = int(temp_name.removeprefix(TEMP_PREFIX).split("-")[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's live process
    return pid != os.getpid()


class TierStore:
    """The entries of one identity in a directory: scan, read, write, delete."""

    def __init__(self, root: str | os.PathLike[str], identity: TierIdentity) -> None:
        self.identity = identity
        self.root = Path(root)
        self.folder = self.root / identity.key
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where the folder should be, no permission, a read-only disk
            raise ConfigError(f"kv_offload_path {self.root}: cannot make the tier's folder there: {e.strerror or e}") from None
        self._temp_counter = 0
        self._claim_folder()
        self.entries = self._scan()  # (digest, bytes) found at start, least recently used first

    @property
    def entry_bytes(self) -> int:
        return ENTRY_HEADER.size + self.identity.payload_bytes

    @property
    def state_entry_bytes(self) -> int:
        """Bytes of a snapshot's entry (0: the model keeps no recurrent state)."""
        return ENTRY_HEADER.size + self.identity.state_payload_bytes if self.identity.state_payload_bytes else 0

    @property
    def _entry_sizes(self) -> set[int]:
        """The sizes an entry file may have: a block's, and a snapshot's where there are any."""
        return {self.entry_bytes, self.state_entry_bytes} - {0}

    def _claim_folder(self) -> None:
        identity_path = self.folder / IDENTITY_FILE
        mine = self.identity.fields()
        if identity_path.exists():
            try:
                found = json.loads(identity_path.read_text())
            except (OSError, ValueError):
                found = None
            if found != mine:
                logger.warning("prefix-cache tier: %s names another identity; its entries are removed", identity_path)
                for path in self.folder.iterdir():
                    path.unlink(missing_ok=True)
        self._write_atomically(identity_path, json.dumps(mine, indent=1).encode())
        for other in sorted(self.root.iterdir()):
            if other == self.folder or not (other / IDENTITY_FILE).is_file():
                continue
            try:
                theirs = TierIdentity(**json.loads((other / IDENTITY_FILE).read_text()))
                what = theirs.describe()
            except (OSError, ValueError, TypeError):
                what = "an unreadable identity"
            logger.info("prefix-cache tier: ignoring %s, written by another model or format: %s", other, what)

    def _scan(self) -> list[tuple[bytes, int]]:
        found: list[tuple[float, bytes, int]] = []
        for path in self.folder.iterdir():
            name = path.name
            if name.startswith(TEMP_PREFIX):
                if not _writer_alive(name):
                    path.unlink(missing_ok=True)  # a write that never finished
                continue
            if not name.endswith(ENTRY_SUFFIX):
                continue
            try:
                digest = bytes.fromhex(name.removesuffix(ENTRY_SUFFIX))
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if len(digest) != DIGEST_BYTES or stat.st_size not in self._entry_sizes:
                logger.info("prefix-cache tier: removing %s (truncated or foreign)", path)
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, digest, stat.st_size))
        found.sort()
        if found:
            logger.info("prefix-cache tier: %s found in %s", self.describe_entries([size for _, _, size in found]), self.folder)
        return [(digest, size) for _, digest, size in found]

    def describe_entries(self, sizes: list[int]) -> str:
        """'N blocks' (and 'and M snapshots' for a hybrid model's) of entries of these sizes."""
        snapshots = sum(1 for size in sizes if size == self.state_entry_bytes) if self.state_entry_bytes else 0
        text = f"{len(sizes) - snapshots} blocks of {self.entry_bytes} bytes"
        return text + (f" and {snapshots} snapshots of {self.state_entry_bytes} bytes" if self.state_entry_bytes else "")

    def path_of(self, digest: bytes) -> Path:
        return self.folder / (digest.hex() + ENTRY_SUFFIX)

    def write(self, digest: bytes, payload: memoryview, state: bool = False) -> int:
        """Store a block, or a snapshot (`state`), atomically; returns the bytes on disk."""
        magic = STATE_MAGIC if state else ENTRY_MAGIC
        header = ENTRY_HEADER.pack(magic, digest, payload.nbytes, zlib.crc32(payload))
        self._write_atomically(self.path_of(digest), header, payload)
        return len(header) + payload.nbytes

    def _write_atomically(self, path: Path, *parts: bytes | memoryview) -> None:
        self._temp_counter += 1
        temp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{self._temp_counter}")
        try:
            with open(temp, "wb") as handle:
                for part in parts:
                    handle.write(part)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def read(self, digest: bytes, state: bool = False) -> bytearray:
        """A block's (or a snapshot's) entry, header and payload, checked; raises
        TierEntryError (and removes the file) if it is missing, truncated or corrupt."""
        data = bytearray(self.state_entry_bytes if state else self.entry_bytes)
        self.read_into(digest, memoryview(data), state)
        return data

    def read_into(self, digest: bytes, out: memoryview, state: bool = False) -> None:
        """Read and check a block's entry (a snapshot's: `state`) into `out`, as long as
        the entry; raises TierEntryError (and removes the file) if it is missing,
        truncated or corrupt."""
        path = self.path_of(digest)
        expected = self.state_entry_bytes if state else self.entry_bytes
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                num_read = handle.readinto(out) if size == expected else 0
        except FileNotFoundError as error:
            raise TierEntryError(f"{path.name} is missing") from error
        except OSError as error:
            raise TierEntryError(f"{path.name} cannot be read: {error}") from error
        problem = f"has {size} bytes, not {expected}" if num_read != expected else self._check(out, digest, state)
        if problem is not None:
            path.unlink(missing_ok=True)
            raise TierEntryError(f"{path.name} {problem}; removed")
        try:  # recency survives a restart (the scan orders entries by it)
            os.utime(path)
        except OSError:
            pass

    def _check(self, data: memoryview, digest: bytes, state: bool) -> str | None:
        magic, stored_digest, length, crc = ENTRY_HEADER.unpack_from(data)
        expected = (STATE_MAGIC, self.identity.state_payload_bytes) if state else (ENTRY_MAGIC, self.identity.payload_bytes)
        if (magic, length) != expected or stored_digest != digest:
            return "has a foreign header"
        if zlib.crc32(data[ENTRY_HEADER.size :]) != crc:
            return "fails its checksum"
        return None

    def delete(self, digest: bytes) -> None:
        self.path_of(digest).unlink(missing_ok=True)


__all__ = ["TierEntryError", "TierIdentity", "TierStore", "weights_digest"]
