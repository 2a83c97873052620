"""Kernels stage: CPU: the i-quants' codebooks for the native kernels (csrc/quant_groups.h).

IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M pick each run of 8 (IQ3: 4)
weights from a fixed table by an index stored in the block; IQ4_NL and IQ4_XS map each
4-bit code to one of 16 signed values. The tables are not written out here: they are read
back from the `gguf` package's reference dequantization, by dequantizing blocks that
select every entry in turn with a unit scale and no signs, so the kernels and the
reference that tests them agree by construction on what the format means.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# Each grid type: (entries, values per entry, bytes per block) and how to write a probe block
# whose sub-block selects entries start .. start + per_block - 1 (unit scale, no signs).


def _blocks(qtype: T, count: int, block_bytes: int) -> np.ndarray:
    return np.zeros((count, block_bytes), dtype=np.uint8)


def _unit_half(blocks: np.ndarray, at: int = 0) -> None:
    blocks[:, at : at + 2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)


def _dequantized(qtype: T, blocks: np.ndarray) -> np.ndarray:  # float64 [blocks, 256]
    return np.asarray(dequantize(blocks.reshape(-1), qtype), dtype=np.float64).reshape(blocks.shape[0], -1)


def _iq2xxs() -> np.ndarray:  # [256, 8]: 32 entries per block (4 per sub-block of 32)
    blocks = _blocks(T.IQ2_XXS, 8, 66)
    _unit_half(blocks)
    for b in range(8):
        for ib in range(8):
            blocks[b, 2 + 8 * ib : 2 + 8 * ib + 4] = np.arange(32 * b + 4 * ib, 32 * b + 4 * ib + 4)
    return _dequantized(T.IQ2_XXS, blocks).reshape(256, 8) / 0.125  # scale d (0.5 + 0) / 4


def _iq2xs() -> np.ndarray:  # [512, 8]: 32 entries per block (16-bit: 9-bit index, 7-bit sign)
    blocks = _blocks(T.IQ2_XS, 16, 74)
    _unit_half(blocks)
    for b in range(16):
        blocks[b, 2:66] = np.arange(32 * b, 32 * b + 32, dtype=np.uint16).view(np.uint8)
    return _dequantized(T.IQ2_XS, blocks).reshape(512, 8) / 0.125


def _iq2s() -> np.ndarray:  # [1024, 8]: 32 entries per block, 10-bit index split over qs and qh
    blocks = _blocks(T.IQ2_S, 32, 82)
    _unit_half(blocks)
    for b in range(32):
        index = np.arange(32 * b, 32 * b + 32)
        blocks[b, 2:34] = index & 0xFF
        high = (index >> 8).reshape(8, 4) << np.array([0, 2, 4, 6])
        blocks[b, 66:74] = high.sum(axis=1)
    return _dequantized(T.IQ2_S, blocks).reshape(1024, 8) / 0.125


def _iq3xxs() -> np.ndarray:  # [256, 4]: 64 entries per block
    blocks = _blocks(T.IQ3_XXS, 4, 98)
    _unit_half(blocks)
    for b in range(4):
        blocks[b, 2:66] = np.arange(64 * b, 64 * b + 64)
    return _dequantized(T.IQ3_XXS, blocks).reshape(256, 4) / 0.25  # scale d (0.5 + 0) / 2


def _iq3s() -> np.ndarray:  # [512, 4]: 64 entries per block, the ninth bit in qh
    blocks = _blocks(T.IQ3_S, 8, 110)
    _unit_half(blocks)
    for b in range(8):
        index = np.arange(64 * b, 64 * b + 64)
        blocks[b, 2:66] = index & 0xFF
        blocks[b, 66:74] = ((index >> 8).reshape(8, 8) << np.arange(8)).sum(axis=1)
    return _dequantized(T.IQ3_S, blocks).reshape(512, 4)  # scale d (1 + 0)


def _iq1s() -> np.ndarray:  # [2048, 8] in {-1, 0, 1}: 32 entries per block, 11-bit index
    blocks = _blocks(T.IQ1_S, 64, 50)
    _unit_half(blocks)
    for b in range(64):
        index = np.arange(32 * b, 32 * b + 32)
        blocks[b, 2:34] = index & 0xFF
        high = ((index >> 8).reshape(8, 4) << np.array([0, 3, 6, 9])).sum(axis=1)  # scale 0: d x 1, delta +1/8
        blocks[b, 34:50] = high.astype(np.uint16).view(np.uint8)
    return _dequantized(T.IQ1_S, blocks).reshape(2048, 8) - 0.125


def _iq4nl() -> np.ndarray:  # [16]
    blocks = _blocks(T.IQ4_NL, 1, 18)
    _unit_half(blocks)
    blocks[0, 2:18] = np.arange(16)
    return _dequantized(T.IQ4_NL, blocks)[0, :16]


def _as_bytes(values: np.ndarray, dtype: type) -> np.ndarray:
    integers = np.rint(values)
    if not np.array_equal(integers, values):
        raise ValueError("a codebook read back from gguf's dequantization is not integral")
    return np.ascontiguousarray(integers.astype(np.int8)).view(np.uint8).view(dtype).reshape(-1)


@functools.cache
def codebooks() -> dict[str, np.ndarray]:
    """Each table as the kernels read it: 8 (IQ3: 4) magnitudes of an entry, one byte each,
    as one uint64 (uint32); IQ1's values and IQ4's as int8."""
    return {
        "iq2xxs": _as_bytes(_iq2xxs(), np.uint64),
        "iq2xs": _as_bytes(_iq2xs(), np.uint64),
        "iq2s": _as_bytes(_iq2s(), np.uint64),
        "iq3xxs": _as_bytes(_iq3xxs(), np.uint32),
        "iq3s": _as_bytes(_iq3s(), np.uint32),
        "iq1s": _as_bytes(_iq1s(), np.uint64),
        "iq4nl": _as_bytes(_iq4nl(), np.int8),
    }


def install(library: ctypes.CDLL) -> None:
    """Hand the tables to a loaded kernel library (before any kernel reads an i-quant)."""
    tables = codebooks()
    library.quant_set_codebooks(*(tables[name].ctypes.data for name in ("iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s", "iq4nl")))
