"""Bench stage: random GGUF quantization blocks of every type the kernels know, for the
quantized benchmarks (benchmarks/quant_1b.py, quant_linear.py) and the kernel tests.

Quantized bytes are uniformly random (every bit pattern of the integers is a valid
block); the fp16 scales (MXFP4: its E8M0 exponents) are drawn at a chosen magnitude, so a
test can push them to extremes. The reference is the `gguf` package's own dequantization.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagellm.kernels.weights import WeightType, block_bytes, file_row_bytes, pack_rows

# Byte offsets of each block's fp16 fields (scale d, and min / dmin where there is one);
# IQ1_M spreads its d over the top nibbles of its four 16-bit scales, F16 is all values.
_HALF_FIELDS = {
    WeightType.Q4_0: (0,), WeightType.Q4_1: (0, 2), WeightType.Q8_0: (0,),
    WeightType.Q4_K: (0, 2), WeightType.Q5_K: (0, 2), WeightType.Q6_K: (208,), WeightType.MXFP4: (),
    WeightType.Q5_0: (0,), WeightType.Q5_1: (0, 2), WeightType.Q2_K: (80, 82), WeightType.Q3_K: (108,),
    WeightType.IQ4_NL: (0,), WeightType.IQ4_XS: (0,), WeightType.IQ3_XXS: (0,), WeightType.IQ3_S: (0,),
    WeightType.IQ2_XXS: (0,), WeightType.IQ2_XS: (0,), WeightType.IQ2_S: (0,), WeightType.IQ1_S: (0,),
    WeightType.IQ1_M: (), WeightType.TQ1_0: (52,), WeightType.TQ2_0: (64,), WeightType.F16: (),
}  # fmt: skip
QUANT_TYPES = tuple(_HALF_FIELDS)


def random_blocks(
    weight_type: WeightType, rows: int, k: int, rng: np.random.Generator, scale: float = 0.01
) -> np.ndarray:  # uint8 [rows, row_bytes]
    if weight_type is WeightType.F16:  # values of about the scale's size, times a few
        return np.clip(rng.standard_normal((rows, k)) * scale * 8, -6e4, 6e4).astype(np.float16).view(np.uint8)
    data = rng.integers(0, 256, size=(rows, file_row_bytes(weight_type, k)), dtype=np.uint8)
    blocks = data.reshape(rows, -1, block_bytes(weight_type))
    for offset in _HALF_FIELDS[weight_type]:
        halves = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if weight_type is WeightType.MXFP4:  # each block's exponent byte E (2^(E - 127)) around the scale
        exponent = round(np.log2(scale)) + 127 + rng.integers(-3, 4, size=blocks.shape[:2])
        blocks[:, :, 0] = np.clip(exponent, 2, 254).astype(np.uint8)
    if weight_type is WeightType.IQ1_M:  # d's 4-bit pieces at the top of scales 0..3
        d = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16).view(np.uint16)
        scales = blocks[:, :, 48:56].copy().view(np.uint16)  # [rows, blocks, 4]
        for i in range(4):
            scales[:, :, i] = (scales[:, :, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, :, 48:56] = scales.view(np.uint8)
    return data


def reference_weight(weight_type: WeightType, data: np.ndarray, k: int) -> np.ndarray:  # float64 [rows, k]
    values = dequantize(data.reshape(-1), GGMLQuantizationType(int(weight_type)))
    return np.asarray(values, dtype=np.float64).reshape(data.shape[0], k)


def packed(weight_type: WeightType, data: np.ndarray, k: int):  # torch uint8 [rows, row_bytes]
    """File blocks in the layout the kernels hold (kernels/weights.py pack_rows)."""
    import torch

    return torch.from_numpy(pack_rows(weight_type, data, k))
