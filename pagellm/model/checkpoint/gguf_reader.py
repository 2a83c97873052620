"""Model stage: open a GGUF file: its reader, checked and opened once per process.

The model config, the tokenizer and the weights each read the same file; parsing a
vocabulary's ~100k strings takes the reader about a second, so one reader is kept per file
(by identity: path, inode, size, modification time) and shared. A reader is read-only.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from pagellm.errors import ModelLoadError


class _CheckedReader(GGUFReader):
    """GGUFReader that names the tensor whose bytes run past the end of the file (a
    truncated download) instead of failing on a reshape deep inside the reader, and reads
    the metadata faster."""

    def _build_fields(self, offs: int, count: int) -> int:
        # The reader slices its data once per string (a vocabulary: ~100k of them): slices of
        # the np.memmap subclass cost several times those of a plain array view of the same
        # mapping (measured: 3.3-3.7 s against 1.0-1.2 s for SmolLM2's 49k tokens and merges).
        mapping = self.data
        self.data = mapping.view(np.ndarray)
        try:
            return super()._build_fields(offs, count)
        finally:
            self.data = mapping

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        file_bytes = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_dtype[0])]
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block_size
            if end > file_bytes:
                name = bytes(name_data).decode("utf-8", "replace")
                raise ModelLoadError(
                    f"tensor {name} ends at byte {end} but the file has {file_bytes} bytes (truncated or corrupted)"
                )
        super()._build_tensors(start_offs, fields)


# Opened readers, by file identity.
_READERS: OrderedDict[tuple[str, int, int, int], GGUFReader] = OrderedDict()
_READERS_KEPT = 2
_READERS_LOCK = threading.Lock()


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader (the same object again while the file is unchanged). Read-only:
    callers must not change it."""
    try:
        stat = os.stat(path)
    except OSError as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e.strerror or e})") from None
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is not None:
            _READERS.move_to_end(key)
            return reader
    try:
        reader = _CheckedReader(str(path))
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad bytes
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e})") from None
    with _READERS_LOCK:
        _READERS[key] = reader
        while len(_READERS) > _READERS_KEPT:
            _READERS.popitem(last=False)
    return reader


def release_resident_pages(reader: GGUFReader) -> None:
    """Drop the file's pages from this process's resident memory (they stay in the page
    cache). Once the weights are copied out (repacked or dequantized), nothing reads the
    mapping but the odd metadata lookup, which pages back in what it reads; without this
    the whole file (94 MiB for SmolLM2) stays in the RSS beside the copies."""
    mapping = getattr(reader.data, "_mmap", None)  # np.memmap's mmap object
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        mapping.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):
        pass
