"""Kernels stage: CPU: a linear layer's weight as the native kernels see it (csrc/weights.h).

A `PackedWeight` is one to three parts stacked along the output dimension, each either
bf16 rows or rows of quantization blocks exactly as a GGUF file stores them (Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), or int8 rows with one float32 scale per row (`--quantization
int8`). The kernels multiply by it without a dequantized copy (csrc/quant_linear.c).
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.errors import ModelLoadError
from pagellm.kernels import abi
from pagellm.kernels.build import load_kernels


class WeightType(enum.IntEnum):
    """The types the kernels know; GGML's numbers where GGML has the type."""

    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39  # OCP microscaling: 32 E2M1 values sharing an E8M0 exponent (gpt-oss's experts)
    I8_ROW = 1000  # int8 rows, per-row float32 scales
    Q4_0_VNNI = 1002  # Q4_0 repacked for the int8-activation kernel (vnni_part)
    Q4_1_VNNI = 1003
    MXFP4_VNNI = 1004

    @property
    def block_elements(self) -> int:
        """Weights per block along a row (F16: the kernels read 32 at a time)."""
        return 32 if self in _GROUP_TYPES else 256

    @property
    def label(self) -> str:
        return {WeightType.I8_ROW: "int8", WeightType.Q4_0_VNNI: "Q4_0 VNNI", WeightType.Q4_1_VNNI: "Q4_1 VNNI",
                WeightType.MXFP4_VNNI: "MXFP4 VNNI"}.get(
            self, self.name
        )


# Bytes of one block as a GGUF file stores it (F16: 32 values, the kernels' unit).
_BLOCK_BYTES = {
    WeightType.Q4_0: 18, WeightType.Q4_1: 20, WeightType.Q8_0: 34, WeightType.MXFP4: 17,
    WeightType.Q5_0: 22, WeightType.Q5_1: 24, WeightType.IQ4_NL: 18, WeightType.F16: 64,
    WeightType.Q4_K: 144, WeightType.Q5_K: 176, WeightType.Q6_K: 210, WeightType.Q2_K: 84, WeightType.Q3_K: 110,
    WeightType.IQ4_XS: 136, WeightType.IQ3_XXS: 98, WeightType.IQ3_S: 110, WeightType.IQ2_XXS: 66,
    WeightType.IQ2_XS: 74, WeightType.IQ2_S: 82, WeightType.IQ1_S: 50, WeightType.IQ1_M: 56,
    WeightType.TQ1_0: 54, WeightType.TQ2_0: 66,
}  # fmt: skip
# The types whose blocks hold 32 weights (the others 256; BF16 and int8 rows are not blocks).
_GROUP_TYPES = frozenset({
    WeightType.Q4_0, WeightType.Q4_1, WeightType.Q8_0, WeightType.MXFP4, WeightType.Q5_0, WeightType.Q5_1,
    WeightType.IQ4_NL, WeightType.F16, WeightType.BF16, WeightType.I8_ROW, WeightType.Q4_0_VNNI, WeightType.Q4_1_VNNI,
    WeightType.MXFP4_VNNI,
})  # fmt: skip
QUANTIZED_TYPES = frozenset(_BLOCK_BYTES)
MAX_PARTS = abi.MAX_PARTS


ROW_PACKED_TYPES = frozenset({WeightType.Q4_0, WeightType.Q4_1, WeightType.Q8_0, WeightType.MXFP4})
# The types whose rows pair their groups' nibbles (pack_rows), and each block's header bytes.
_NIBBLE_HEADER = {WeightType.Q4_0: 2, WeightType.Q4_1: 4, WeightType.MXFP4: 1}
# The int8-activation kernel's layout of each type it reads (vnni_part).
VNNI_OF = {WeightType.Q4_0: WeightType.Q4_0_VNNI, WeightType.Q4_1: WeightType.Q4_1_VNNI,
           WeightType.MXFP4: WeightType.MXFP4_VNNI}


def block_bytes(weight_type: WeightType) -> int:
    """Bytes of one quantization block as a GGUF file stores it."""
    return _BLOCK_BYTES[weight_type]


def _padded_groups(k: int) -> int:
    return (k // 32 + 1) // 2 * 2


def row_bytes(weight_type: WeightType, k: int) -> int:
    """Bytes of one row as the kernels hold it (after `pack_rows`)."""
    if weight_type is WeightType.BF16:
        return 2 * k
    if weight_type is WeightType.I8_ROW:
        return k
    if weight_type in VNNI_OF.values():
        weight_type = next(t for t, vnni in VNNI_OF.items() if vnni is weight_type)
    if weight_type in _NIBBLE_HEADER:
        return _padded_groups(k) * _BLOCK_BYTES[weight_type]
    return file_row_bytes(weight_type, k)


def file_row_bytes(weight_type: WeightType, k: int) -> int:
    """Bytes of one row of GGUF blocks as the file stores them."""
    return k // weight_type.block_elements * _BLOCK_BYTES[weight_type]


def pack_rows(weight_type: WeightType, blocks: np.ndarray, k: int) -> np.ndarray:
    """GGUF rows of blocks (uint8 [rows, file_row_bytes]) in the layout the kernels read.

    Q4_0 / Q4_1 / MXFP4 / Q8_0 are rearranged (same bytes, see csrc/quant_linear.c): 4-bit
    rows keep the nibbles of groups 2p and 2p + 1 in one 32-byte run (2p low, 2p + 1 high,
    element order) then the fp16 scales (and mins; MXFP4: the one-byte exponents); Q8_0 rows
    keep all int8 values then the scales. K-quant blocks stay exactly as stored.
    """
    if weight_type not in ROW_PACKED_TYPES:
        return blocks
    rows = blocks.shape[0]
    groups = k // 32
    per_block = blocks.reshape(rows, groups, _BLOCK_BYTES[weight_type])
    if weight_type is WeightType.Q8_0:
        return np.concatenate([per_block[:, :, 2:].reshape(rows, -1), per_block[:, :, :2].reshape(rows, -1)], axis=1)
    header = _NIBBLE_HEADER[weight_type]
    padded = _padded_groups(k)
    if padded != groups:  # a zero group (scale 0, min 0) completes the last pair
        per_block = np.concatenate([per_block, np.zeros((rows, 1, per_block.shape[2]), np.uint8)], axis=1)
    packed = per_block[:, :, header:]  # [rows, padded, 16]: byte j = element j | element j + 16 << 4
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # [rows, padded, 32] in element order
    pairs = values.reshape(rows, padded // 2, 2, 32)
    nibbles = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(rows, -1)
    scales = [per_block[:, :, 0 : min(header, 2)].reshape(rows, -1)]
    if weight_type is WeightType.Q4_1:
        scales.append(per_block[:, :, 2:4].reshape(rows, -1))
    return np.ascontiguousarray(np.concatenate([nibbles, *scales], axis=1))


@dataclass(frozen=True)
class WeightPart:
    """Rows of one stored type: `data` is uint8 [rows, row_bytes] (bf16 [rows, k] for BF16)."""

    type: WeightType
    data: torch.Tensor
    row_scales: torch.Tensor | None = None  # float32 [rows], I8_ROW only

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.row_scales is None else self.row_scales.numel() * 4
        return self.data.numel() * self.data.element_size() + scales


def check_part(part: WeightPart, k: int, name: str) -> None:
    """A part whose bytes do not match its type and shape is a clear error, not a crash."""
    if k % part.type.block_elements:
        raise ModelLoadError(f"{name}: {part.type.label} needs rows of a multiple of {part.type.block_elements} values, not {k}")
    expected = row_bytes(part.type, k)
    width = part.data.shape[1] * part.data.element_size() if part.data.dim() == 2 else -1
    if width != expected or not part.data.is_contiguous():
        raise ModelLoadError(
            f"{name}: {part.type.label} rows of {k} values take {expected} bytes, the tensor holds "
            f"{width} (truncated or corrupted)"
        )


def vnni_part(part: WeightPart, k: int) -> WeightPart:
    """A Q4_0 / Q4_1 / MXFP4 part (pack_rows' layout) in the int8-activation kernel's order: per 16
    groups (256 bytes of nibbles), byte 64 L + 4 g + i holds element 8 L + i of group g
    (low nibble) and element 8 L + 4 + i (high nibble), so each 32-bit lane of a VNNI dot
    product sums one group (csrc/quant_int8.c, quant_int8_repack). The groups after the last
    16 and the scales stay as they were: the same bytes, reordered."""
    out = torch.empty_like(part.data)
    load_kernels().quant_int8_repack(part.data.data_ptr(), out.data_ptr(), part.rows, part.data.shape[1], k)
    return WeightPart(VNNI_OF[part.type], out)


def int8_kernel_part(part: WeightPart, k: int) -> WeightPart:
    """A Q4_0 / Q4_1 / MXFP4 part as this machine's int8-activation kernel reads it: repacked into
    the lane order on the VNNI builds (vnni_part), as stored on the AVX2 builds."""
    library = load_kernels()
    repack = part.type in VNNI_OF and library is not None and library.quant_int8_supported(int(VNNI_OF[part.type]))
    return vnni_part(part, k) if repack else part


class PackedWeight:
    """W [out_features, in_features] in its stored parts, with the structure the kernels read."""

    def __init__(self, parts: list[WeightPart], in_features: int) -> None:
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"a packed weight has 1 to {MAX_PARTS} parts, not {len(parts)}")
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self._library = load_kernels()
        self._struct = abi.Weight(len(parts))
        for i, part in enumerate(parts):
            self._struct.parts[i] = _part_struct(part)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def types(self) -> list[WeightType]:
        return [p.type for p in self.parts]

    def struct_address(self) -> int:
        return ctypes.addressof(self._struct)

    def linear(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        num_threads: int,
        impl: int = 0,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """x [m, in_features] bf16 (unit column stride) -> [m, out_features] bf16 or float32;
        impl: the native kernel (kernels/linear_bindings.py LinearImpl, 0 = by row count)."""
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=out_dtype)
        if m:
            self._library.linear_weight(
                x.data_ptr(), x.stride(0), self.struct_address(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), self.out_features, out_dtype is torch.float32, m, self.in_features, impl, num_threads,
            )  # fmt: skip
        return out

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:  # [out_features, in_features] bf16
        """The weight as bf16, into `out` (a scratch buffer of that shape) or a new tensor."""
        if out is None:
            out = torch.empty(self.out_features, self.in_features, dtype=torch.bfloat16)
        row = 0
        for i, part in enumerate(self.parts):
            self._library.dequantize_rows_bf16(
                ctypes.addressof(self._struct.parts[i]), 0, part.rows, self.in_features, out[row].data_ptr()
            )
            row += part.rows
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:  # ids [n] int64 -> [n, in_features] bf16
        assert len(self.parts) == 1, "an embedding table is one part"
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.bfloat16)
        if ids.numel():
            self._library.gather_rows_bf16(
                ctypes.addressof(self._struct.parts[0]), ids.data_ptr(), ids.numel(), self.in_features, out.data_ptr()
            )
        return out


def _part_struct(part: WeightPart) -> abi.WeightPart:
    return abi.WeightPart(
        int(part.type), part.rows, part.data.shape[1] * part.data.element_size(), part.data.data_ptr(),
        None if part.row_scales is None else part.row_scales.data_ptr(),
    )


def bf16_weight(weight: torch.Tensor) -> PackedWeight:
    """A bf16 [n, k] parameter as a one-part weight (the decode layer reads every linear so)."""
    return PackedWeight([WeightPart(WeightType.BF16, weight)], weight.shape[1])


def quantize_int8_rows(weight: torch.Tensor) -> WeightPart:
    """Weight-only int8 with one scale per output row: scale = max|w| / 127, q = round(w / scale)."""
    w = weight.to(torch.float32)
    scales = w.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return WeightPart(WeightType.I8_ROW, q.view(torch.uint8).contiguous(), scales.contiguous())


def kernels_support(weight_type: WeightType) -> bool:
    library = load_kernels()
    return library is not None and bool(library.quant_type_supported(int(weight_type)))
