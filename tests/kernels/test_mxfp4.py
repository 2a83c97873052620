"""MXFP4 (OCP microscaling, gpt-oss's experts) against the format's own definition.

An element is a 4-bit E2M1 number: sign bit, two exponent bits e, one mantissa bit m, worth
m / 2 where e = 0 and 2^(e - 1) (1 + m / 2) above; each group of 32 shares an E8M0 scale
byte E worth 2^(E - 127). The float64 reference below decodes the bits so; the gguf
package's dequantization, transformers' reading of OpenAI's layout, our repacking of that
layout and the kernels' dequantization on every build must all give the same numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pagellm.kernels.weights import PackedWeight, WeightPart, WeightType, kernels_support, pack_rows
from pagellm.model.loader.mxfp4_experts import dequantize_mxfp4, gguf_blocks


def e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))


def reference(codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """codes [..., 32] (0..15), exponents [...]: float64 values [..., 32]."""
    table = np.array([e2m1(c) for c in range(16)])
    return table[codes] * np.exp2(exponents.astype(np.float64) - 127)[..., None]


def random_groups(rng: np.random.Generator, rows: int, groups: int, low: int = 100, high: int = 150):
    codes = rng.integers(0, 16, size=(rows, groups, 32), dtype=np.uint8)
    codes[0, 0] = np.arange(32) % 16  # every code appears
    exponents = rng.integers(low, high, size=(rows, groups), dtype=np.uint8)
    return codes, exponents


def ggml_blocks(codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:  # [rows, groups * 17]
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([exponents[..., None], nibbles], axis=-1).reshape(codes.shape[0], -1)


def test_the_gguf_package_reads_the_definition():
    rng = np.random.default_rng(0)
    codes, exponents = random_groups(rng, 8, 5, low=0, high=253)  # 6 x 2^(252 - 127) is float32's last
    exponents[0, :3] = (0, 1, 252)  # the subnormal scales and the largest
    values = dequantize(ggml_blocks(codes, exponents).reshape(-1), GGMLQuantizationType.MXFP4).reshape(8, -1)
    np.testing.assert_array_equal(values.astype(np.float64), reference(codes, exponents).reshape(8, -1))


def test_openai_layout_repacked_equals_transformers_reading():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(1)
    experts, rows, groups = 3, 6, 4
    codes, exponents = random_groups(rng, experts * rows, groups)
    codes, exponents = codes.reshape(experts, rows, groups, 32), exponents.reshape(experts, rows, groups)
    hf_blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # byte j: elements 2j, 2j + 1
    theirs = mxfp4._convert_moe_packed_tensors(torch.from_numpy(hf_blocks), torch.from_numpy(exponents), dtype=torch.float32)
    ours = dequantize(gguf_blocks(hf_blocks, exponents).reshape(-1), GGMLQuantizationType.MXFP4)
    ours = ours.reshape(experts, rows, groups * 32)
    np.testing.assert_array_equal(ours, theirs.transpose(1, 2).numpy())  # theirs: [experts, in, out]
    np.testing.assert_array_equal(ours, reference(codes, exponents).reshape(experts, rows, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_dequantization_is_exact(dtype):
    """The torch path (a GPU model's experts, dequantized on the device; here on the CPU)."""
    rng = np.random.default_rng(2)
    codes, exponents = random_groups(rng, 9, 7)
    stored = torch.from_numpy(ggml_blocks(codes, exponents))
    values = dequantize_mxfp4(stored, 7 * 32, dtype)
    assert values.dtype == dtype
    np.testing.assert_array_equal(values.double().numpy(), reference(codes, exponents).reshape(9, -1))


@pytest.mark.skipif(not kernels_support(WeightType.MXFP4), reason="needs the native CPU kernels (x86-64 with AVX2)")
@pytest.mark.parametrize("groups", [1, 3, 8, 33], ids=lambda g: f"{g}groups")
def test_kernels_dequantize_and_gather_exactly(groups, kernel_isa):
    """Every E2M1 value times a power of two is a bf16 number: the kernels' bf16 rows are exact."""
    rng = np.random.default_rng(groups)
    codes, exponents = random_groups(rng, 12, groups)
    k = 32 * groups
    part = WeightPart(WeightType.MXFP4, torch.from_numpy(pack_rows(WeightType.MXFP4, ggml_blocks(codes, exponents), k)))
    weight = PackedWeight([part], k)
    expected = reference(codes, exponents).reshape(12, k)
    np.testing.assert_array_equal(weight.dequantize().double().numpy(), expected)
    ids = torch.tensor([11, 0, 5, 5])
    np.testing.assert_array_equal(weight.gather(ids).double().numpy(), expected[ids.numpy()])
