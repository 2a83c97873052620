"""The int8-activation streaming kernels for Q4_0 and Q4_1 weights (csrc/quant_int8.c: on
the VNNI builds repacked into its lane order, weights.vnni_part; on the AVX2 builds as
stored; MXFP4 the same way), for the K-quants (Q2_K to Q6_K), IQ4_XS and IQ3_S as stored
(csrc/quant_int8_k.c, VNNI builds) and for Q8_0 as stored (csrc/quant_int8_q8.c, VNNI builds). Every test runs on each kernel build the host executes (the kernel_isa fixture), so
an AVX-512 VNNI machine tests the AVX2 kernel too.

Two checks. Against an emulation of its arithmetic in numpy (x rounded to int8 per group of
32 with dx = max|x| / 127, integer dot products, float scales): equal within float32
accumulation, which proves the path ran (the bf16 kernel differs from it by the int8
rounding, hundreds of times more). Against the exact product (float64, gguf's own
dequantization): within the rounding of x, |x_i - dx q_i| <= dx / 2 per value, summed with
|w| over each group. Other weight types (on the VNNI builds, Q4_0 / Q4_1 / MXFP4 not repacked
included), and bf16 weights, asked for the int8 kernel stream as the bf16 kernel does, bit
for bit. A repacked
part holds the same weights: dequantized, gathered and through the panel (GEMM) kernels it
equals the part it came from bit for bit, and the bf16 streaming kernel never reads it (the
int8 kernel is its streaming path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.bench.quant_blocks import packed, random_blocks, reference_weight
from pagellm.kernels.build import load_kernels
from pagellm.kernels.linear_bindings import LinearImpl
from pagellm.kernels.weights import PackedWeight, WeightPart, WeightType, bf16_weight, int8_kernel_part, vnni_part

INT8_TYPES = (WeightType.Q4_0, WeightType.Q4_1, WeightType.MXFP4)
# As stored, on the VNNI builds (quant_int8_k.c):
K_TYPES = (WeightType.Q2_K, WeightType.Q3_K, WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K, WeightType.IQ4_XS,
           WeightType.IQ3_S)
# Widths: blocks of 16 groups, with an odd or even tail, tails only; whole super-blocks for K;
# gpt-oss's 2880 for MXFP4 (90 groups: 5 blocks of 16 and a tail of 10); Q8_0 (as stored,
# quant_int8_q8.c, VNNI builds) also 3 groups (a short run of four).
CASES = (
    [(t, k) for t in INT8_TYPES for k in (512, 1056, 576, 160, 64)]
    + [(t, k) for t in K_TYPES for k in (256, 1280)]
    + [(WeightType.MXFP4, 2880)]
    + [(WeightType.Q8_0, k) for k in (512, 1056, 576, 96)]
)


@pytest.fixture(autouse=True)
def int8_build(kernel_isa):
    """Each kernel build the host runs; all of them have the int8 kernel."""
    library = load_kernels()
    assert library.quant_int8_supported(int(WeightType.Q4_0)) or library.quant_int8_supported(int(WeightType.Q4_0_VNNI))
    return library


def _reads_repacked() -> bool:
    """Whether this build's int8 kernel reads the VNNI layout (else Q4_0 / Q4_1 / MXFP4 as stored)."""
    return bool(load_kernels().quant_int8_supported(int(WeightType.Q4_0_VNNI)))


def _quantized_x(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """x [m, k] rounded as the kernel does: (q [m, k] as float64, dx [m, k / 32])."""
    groups = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(groups).max(axis=2)
    dx = amax / np.float32(127.0)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(groups * inv[:, :, None]).clip(-127, 127)  # round half to even, as the kernel
    return q.reshape(x.shape).astype(np.float64), dx.astype(np.float64)


def _weights(weight_type: WeightType, data: np.ndarray, k: int) -> tuple[PackedWeight, PackedWeight]:
    """The part as pack_rows lays it out, and as this build's int8 kernel reads it."""
    part = WeightPart(weight_type, packed(weight_type, data, k))
    return PackedWeight([part], k), PackedWeight([int8_kernel_part(part, k)], k)


def _run(weight: PackedWeight, x: torch.Tensor, impl: LinearImpl) -> np.ndarray:
    return weight.linear(x, None, 2, int(impl), torch.float32).double().numpy()


@pytest.mark.parametrize(("weight_type", "k"), CASES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("rows", [1, 3, 9, 17])
def test_int8_kernel_equals_its_arithmetic_and_bounds_the_error(weight_type, k, rows):
    if weight_type not in INT8_TYPES and not load_kernels().quant_int8_supported(int(weight_type)):
        pytest.skip(f"this build streams {weight_type.name} with bf16 activations only (no AVX-512 VNNI)")
    rng = np.random.default_rng(k * 10 + rows + int(weight_type))
    n = 37 if rows % 2 else 40  # an odd count: a thread's last weight row alone (one row of x takes two at a time)
    data = random_blocks(weight_type, n, k, rng)
    plain, weight = _weights(weight_type, data, k)
    w = reference_weight(weight_type, data, k)  # float64 [n, k]
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
    y = _run(weight, x, LinearImpl.STREAMING_INT8)

    q, dx = _quantized_x(x)
    emulated = (q * np.repeat(dx, 32, axis=1)) @ w.T
    magnitude = np.abs(q * np.repeat(dx, 32, axis=1)) @ np.abs(w).T
    assert np.all(np.abs(y - emulated) <= 1e-5 * magnitude + 1e-30)

    exact = x.double().numpy() @ w.T
    group_w = np.abs(w).reshape(n, -1, 32).sum(axis=2)  # [n, groups]
    rounding = (0.5 * dx) @ group_w.T  # [rows, n]: sum over groups of dx / 2 * sum |w|
    scale = np.abs(x.double().numpy()) @ np.abs(w).T
    assert np.all(np.abs(y - exact) <= 1.001 * rounding + 1e-5 * scale)
    # ... and the bf16 kernel is not what ran: it is far closer to the exact product.
    bf16 = _run(plain, x, LinearImpl.STREAMING)
    assert np.abs(y - exact).max() > 20 * np.abs(bf16 - exact).max()


def test_zero_and_tiny_groups_of_x():
    rng = np.random.default_rng(5)
    k, n = 256, 24
    data = random_blocks(WeightType.Q4_0, n, k, rng)
    _, weight = _weights(WeightType.Q4_0, data, k)
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
    x[0, :32] = 0.0  # a group of zeros: dx = 0, no division by it
    x[1] *= 1e-30  # subnormal-sized values in bf16
    y = _run(weight, x.to(torch.bfloat16), LinearImpl.STREAMING_INT8)
    assert np.all(np.isfinite(y))
    exact = x.to(torch.bfloat16).double().numpy() @ reference_weight(WeightType.Q4_0, data, k).T
    assert np.abs(y[0] - exact[0]).max() <= 0.02 * np.abs(exact[0]).max()


@pytest.mark.parametrize("weight_type", [WeightType.Q4_0, WeightType.Q4_1, WeightType.Q8_0, WeightType.Q4_K, WeightType.Q6_K], ids=lambda t: t.name)
def test_other_types_stream_as_the_bf16_kernel(weight_type):
    if load_kernels().quant_int8_supported(int(weight_type)):
        pytest.skip(f"this build's int8 kernel reads {weight_type.name} as stored")
    rng = np.random.default_rng(2)
    k, n = 512, 40
    data = random_blocks(weight_type, n, k, rng)
    weight = PackedWeight([WeightPart(weight_type, packed(weight_type, data, k))], k)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32)).to(torch.bfloat16)
    assert np.array_equal(_run(weight, x, LinearImpl.STREAMING_INT8), _run(weight, x, LinearImpl.STREAMING))


def test_bf16_weights_and_mixed_parts():
    # A fused weight with a Q4_0 part and a bf16 part (as qkv with an unquantized v): the
    # Q4_0 part takes int8 activations, the bf16 part streams as before.
    rng = np.random.default_rng(3)
    k = 256
    data = random_blocks(WeightType.Q4_0, 32, k, rng)
    dense = torch.from_numpy(rng.standard_normal((16, k)).astype(np.float32)).to(torch.bfloat16)
    plain_q4, int8_q4 = _weights(WeightType.Q4_0, data, k)
    mixed = PackedWeight([int8_q4.parts[0], bf16_weight(dense).parts[0]], k)
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32)).to(torch.bfloat16)
    y8 = _run(mixed, x, LinearImpl.STREAMING_INT8)
    assert np.array_equal(y8[:, :32], _run(int8_q4, x, LinearImpl.STREAMING_INT8))
    assert not np.array_equal(y8[:, :32], _run(plain_q4, x, LinearImpl.STREAMING))  # int8, not bf16
    assert np.array_equal(y8[:, 32:], _run(bf16_weight(dense), x, LinearImpl.STREAMING))
    only_dense = bf16_weight(dense)
    assert np.array_equal(_run(only_dense, x, LinearImpl.STREAMING_INT8), _run(only_dense, x, LinearImpl.STREAMING))


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_bias_is_added_to_every_row(rows):
    rng = np.random.default_rng(rows)
    k, n = 544, 35  # a block of 16 groups and a tail; odd: weight rows two at a time and one alone
    data = random_blocks(WeightType.Q4_0, n, k, rng)
    _, weight = _weights(WeightType.Q4_0, data, k)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    plain = _run(weight, x, LinearImpl.STREAMING_INT8)
    biased = weight.linear(x, bias, 2, int(LinearImpl.STREAMING_INT8), torch.float32).double().numpy()
    np.testing.assert_allclose(biased, plain + bias.double().numpy()[None, :], rtol=0, atol=1e-5)


@pytest.mark.parametrize("weight_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [512, 1056, 576, 96])
def test_repacked_part_holds_the_same_weights(weight_type, k):
    if not _reads_repacked():
        pytest.skip("this build keeps Q4_0 / Q4_1 / MXFP4 as stored: it never repacks")
    rng = np.random.default_rng(k + int(weight_type))
    n = 24
    plain, repacked = _weights(weight_type, random_blocks(weight_type, n, k, rng), k)
    assert repacked.parts[0].type.label == f"{weight_type.name} VNNI" and repacked.nbytes == plain.nbytes
    assert torch.equal(repacked.dequantize(), plain.dequantize())
    ids = torch.tensor([5, 0, 23, 5])
    assert torch.equal(repacked.gather(ids), plain.gather(ids))
    x = torch.from_numpy(rng.standard_normal((20, k)).astype(np.float32)).to(torch.bfloat16)
    assert np.array_equal(_run(repacked, x, LinearImpl.GEMM), _run(plain, x, LinearImpl.GEMM))
    few = x[:3]  # by row count, and the bf16 streaming kernel's number: the int8 kernel reads it
    assert np.array_equal(_run(repacked, few, LinearImpl.BY_ROWS), _run(repacked, few, LinearImpl.STREAMING_INT8))
    assert np.array_equal(_run(repacked, few, LinearImpl.STREAMING), _run(repacked, few, LinearImpl.STREAMING_INT8))


def _lane_order(data: np.ndarray, k: int) -> np.ndarray:
    """The lane order from its definition (csrc/quant_int8.c's file comment), in numpy:
    element e of group g is byte e of its pair's 32 bytes, in the low nibble for even g."""
    rows, blocks = data.shape[0], k // 32 // 16
    head = data[:, : blocks * 256].reshape(rows, blocks, 8, 32)
    values = np.stack([head & 0x0F, head >> 4], axis=3).reshape(rows, blocks, 16, 4, 2, 4)  # [.., g, L, half, i]
    lanes = (values[..., 0, :] | (values[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)  # byte 64 L + 4 g + i
    return np.concatenate([lanes.reshape(rows, blocks * 256), data[:, blocks * 256 :]], axis=1)


@pytest.mark.parametrize("weight_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [1024, 1056, 576, 96])
def test_repacking_follows_the_lane_order(weight_type, k):
    rng = np.random.default_rng(k)
    part = WeightPart(weight_type, packed(weight_type, random_blocks(weight_type, 7, k, rng), k))
    repacked = vnni_part(part, k)
    assert repacked.type is {WeightType.Q4_0: WeightType.Q4_0_VNNI, WeightType.Q4_1: WeightType.Q4_1_VNNI,
                             WeightType.MXFP4: WeightType.MXFP4_VNNI}[weight_type]
    assert np.array_equal(repacked.data.numpy(), _lane_order(part.data.numpy(), k))
