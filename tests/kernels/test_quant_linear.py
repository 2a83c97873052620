"""The quantized linear kernels (csrc/quant_linear.c, and linear_f32.c in the builds without
AVX-512 BF16) against the gguf package's own dequantization followed by a float64 matmul,
for every type the kernels know, in every kernel build the host CPU executes (kernel_isa).

Tolerance. The kernels read x in bf16 (exact here: x is drawn as bf16) and accumulate in
float32; the result is rounded once to bf16, a relative error of at most 2^-9 of |y|.
Above 16 rows the weights are first dequantized to bf16 (2^-9 relative per weight, so at
most 2^-9 * sum_j |x_j w_j|). Both are within 2^-8 * (|x| @ |W|^T) per output, which is
the bound used (float32 accumulation adds ~2^-24 per term, negligible). A wrong nibble
order, scale or offset moves outputs by O(|x| @ |W|^T), hundreds of times the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.bench.quant_blocks import QUANT_TYPES, packed, random_blocks, reference_weight
from pagellm.kernels.weights import PackedWeight, WeightPart, WeightType, kernels_support, quantize_int8_rows

pytestmark = pytest.mark.skipif(
    not kernels_support(WeightType.Q4_0), reason="quantized kernels need x86-64 with AVX2 and a C compiler"
)
BOUND = 2.0**-8


def _check(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, bias: np.ndarray | None = None) -> None:
    x64 = x.double().numpy()
    ref = x64 @ w.T + (0 if bias is None else bias)
    scale = np.abs(x64) @ np.abs(w).T + (0 if bias is None else np.abs(bias))
    err = np.abs(y.double().numpy() - ref)
    worst = np.unravel_index(np.argmax(err - BOUND * scale), err.shape)
    assert np.all(err <= BOUND * scale + 1e-30), (worst, err[worst], scale[worst])


@pytest.mark.parametrize("weight_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("odd", [False, True], ids=["even", "odd"])
def test_linear_matches_gguf_dequantization(weight_type, odd, kernel_isa):
    # odd: 33 groups of 32 (the row-packed types pad a pair), or 3 K-quant super-blocks.
    # Every row count 1-17 (streamed to 8, then the panels) and 64, one weight for all.
    k = (1056 if weight_type.block_elements == 32 else 768) if odd else 512
    rng = np.random.default_rng(int(weight_type) * 100 + odd)
    n = 40
    data = random_blocks(weight_type, n, k, rng)
    weight = PackedWeight([WeightPart(weight_type, packed(weight_type, data, k))], k)
    reference = reference_weight(weight_type, data, k)
    for rows in [*range(1, 18), 64]:
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
        _check(weight.linear(x, None, 2), x, reference)


@pytest.mark.parametrize("weight_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [6e-8, 1e-4, 30.0, 3000.0], ids=["subnormal", "tiny", "large", "huge"])
def test_extreme_scales(weight_type, scale, kernel_isa):
    """fp16 scales from subnormal to thousands: the products stay within float32."""
    rng = np.random.default_rng(7)
    k, n = 256, 24
    data = random_blocks(weight_type, n, k, rng, scale=scale)
    weight = PackedWeight([WeightPart(weight_type, packed(weight_type, data, k))], k)
    for rows in (1, 20):
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
        _check(weight.linear(x, None, 2), x, reference_weight(weight_type, data, k))


@pytest.mark.parametrize("weight_type", [*QUANT_TYPES, WeightType.I8_ROW], ids=lambda t: t.name)
@pytest.mark.parametrize("spread", ["narrow", "wide"])
def test_streamed_rows_use_x_to_its_own_precision(weight_type, spread, kernel_isa):
    """Streamed rows (1-8) with a float32 output are x . w to float32 accumulation, apart from
    a rounding of at most 2^-16 of each group's largest |x| per value (the AVX2 build's
    integer dot products take x's groups as 16-bit integers times a power of two, the
    K-quants' at 1-2 rows; a group
    whose values are all within 2^7 of its largest is exact: 'narrow'). 'wide' spreads x's
    values over 2^-24..1 within each group, so most of them are rounded. Taking x as int8
    would miss the bound by ~2^8."""
    rng = np.random.default_rng(int(weight_type) + (5 if spread == "wide" else 0))
    k, n = (768 if weight_type.block_elements == 256 else 1056), 24  # 33 groups: a short last span
    if weight_type is WeightType.I8_ROW:
        part = quantize_int8_rows(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
        weight = PackedWeight([part], k)
        w = part.data.view(torch.int8).double().numpy() * part.row_scales.double().numpy()[:, None]
    else:
        data = random_blocks(weight_type, n, k, rng)
        weight = PackedWeight([WeightPart(weight_type, packed(weight_type, data, k))], k)
        w = reference_weight(weight_type, data, k)
    for rows in range(1, 9):
        sign = rng.choice([-1.0, 1.0], size=(rows, k))
        exponent = rng.integers(-7 if spread == "narrow" else -24, 1, size=(rows, k))
        x = torch.from_numpy(sign * rng.uniform(1, 2, size=(rows, k)) * 2.0**exponent).to(torch.bfloat16)
        x64 = x.double().numpy()
        y = weight.linear(x, None, 2, out_dtype=torch.float32).double().numpy()
        group_max = np.abs(x64).reshape(rows, k // 32, 32).max(axis=2)  # [rows, groups]
        w_abs_sums = np.abs(w).reshape(n, k // 32, 32).sum(axis=2)  # [n, groups]
        rounding = 0.0 if spread == "narrow" else 2.0**-16 * group_max @ w_abs_sums.T
        # float32 accumulation: at most ~50 roundings of 2^-24 per lane at these lengths (Q6_K
        # takes two per group), under 2^-18.3 of sum |x w|; 2^-17 leaves room. An 8-bit x errs
        # by ~2^-9 of it.
        accumulation = 2.0**-17 * (np.abs(x64) @ np.abs(w).T)
        err = np.abs(y - x64 @ w.T)
        assert np.all(err <= rounding + accumulation), (rows, (err / (rounding + accumulation)).max())


@pytest.mark.parametrize("weight_type", QUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_and_gather_match_gguf(weight_type, kernel_isa):
    rng = np.random.default_rng(3)
    k, n = 512, 33
    data = random_blocks(weight_type, n, k, rng)
    weight = PackedWeight([WeightPart(weight_type, packed(weight_type, data, k))], k)
    ref = reference_weight(weight_type, data, k)
    # One rounding to bf16 (2^-9 relative), from a float32 value that may differ from
    # gguf's own float32 arithmetic in the last bit: within 2^-8 of |w|.
    assert np.all(np.abs(weight.dequantize().double().numpy() - ref) <= BOUND * np.abs(ref) + 1e-30)
    ids = torch.tensor([5, 0, 32, 5])
    assert torch.equal(weight.gather(ids), weight.dequantize()[ids])


def test_int8_rows_and_strided_x(kernel_isa):
    rng = np.random.default_rng(1)
    w = torch.from_numpy(rng.standard_normal((70, 192)).astype(np.float32))
    part = quantize_int8_rows(w)
    # The quantization itself: within half a step of each row's scale.
    q = part.data.view(torch.int8).double() * part.row_scales.double()[:, None]
    assert torch.all((q - w.double()).abs() <= part.row_scales.double()[:, None] / 2 + 1e-7)
    weight = PackedWeight([part], 192)
    wide = torch.from_numpy(rng.standard_normal((19, 400)).astype(np.float32)).to(torch.bfloat16)
    for rows in (1, 5, 19):
        x = wide[:rows, 100:292]  # a row stride of 400, not 192
        _check(weight.linear(x, None, 2), x, q.numpy())


@pytest.mark.parametrize(
    "types,rows_per_part",
    [
        ((WeightType.Q4_K, WeightType.Q6_K), (48, 16)),  # a fused qkv: q, k, then v in bf16
        ((WeightType.Q4_K, WeightType.Q8_0, WeightType.Q6_K), (40, 24, 4)),  # a Gated DeltaNet's qkv, z, b; a in bf16
    ],
    ids=["3-parts", "4-parts"],
)
def test_parts_of_different_types_with_bias(types, rows_per_part, kernel_isa):
    """A fused projection whose parts are stored in different types, plus a bias."""
    rng = np.random.default_rng(11)
    k = 512
    blocks = [random_blocks(t, rows, k, rng) for t, rows in zip(types, rows_per_part)]
    bf16_rows = torch.from_numpy(rng.standard_normal((16, k)).astype(np.float32) * 0.05).to(torch.bfloat16)
    parts = [WeightPart(t, packed(t, b, k)) for t, b in zip(types, blocks)]
    parts.append(WeightPart(WeightType.BF16, bf16_rows))
    weight = PackedWeight(parts, k)
    full = np.concatenate([reference_weight(t, b, k) for t, b in zip(types, blocks)] + [bf16_rows.double().numpy()])
    bias = torch.from_numpy(rng.standard_normal(sum(rows_per_part) + 16).astype(np.float32)).to(torch.bfloat16)
    for rows in (1, 7, 40):
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
        _check(weight.linear(x, bias, 2), x, full, bias.double().numpy())
    assert weight.nbytes == sum(b.nbytes for b in blocks) + bf16_rows.numel() * 2


@pytest.mark.parametrize("weight_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_or_inf_in_x_is_not_hidden(weight_type, bad, kernel_isa):
    # A NaN (or an Inf) in a row of x makes that row's outputs non-finite, at every streamed
    # row count and in the GEMM, and leaves the other rows finite.
    rng = np.random.default_rng(2)
    data = random_blocks(weight_type, 16, 256, rng)
    weight = PackedWeight([WeightPart(weight_type, packed(weight_type, data, 256))], 256)
    for rows in (2, 8, 20):
        x = torch.from_numpy(rng.standard_normal((rows, 256)).astype(np.float32)).to(torch.bfloat16)
        x[1, 7] = bad
        y = weight.linear(x, None, 2, out_dtype=torch.float32)
        assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any(), rows


# The row counts at every bucket edge of the measured kernel choice (kernels/linear_choice.py).
BUCKET_EDGE_ROWS = [1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 256, 257]
# The types read through quant_groups.h's generic group decoder share every loop past the
# decoding (tested at every row count 1-17 above), whose edges (streamed 8 rows at a time,
# panels above 8 or 16, the GEMM's larger tiles) these cross; the edge at 256 rows is the
# same panel loop again, crossed by the hand-kernel types.
GENERIC_EDGE_ROWS = [1, 8, 9, 17, 65]
HAND_KERNEL_TYPES = {WeightType.Q4_0, WeightType.Q4_1, WeightType.Q8_0, WeightType.MXFP4, WeightType.Q4_K,
                     WeightType.Q5_K, WeightType.Q6_K, WeightType.I8_ROW, WeightType.BF16}  # fmt: skip


@pytest.mark.parametrize("impl", ["streaming", "gemm", "amx", "onednn", "onednn_f32"])
@pytest.mark.parametrize("weight_type", [*QUANT_TYPES, WeightType.I8_ROW, WeightType.BF16], ids=lambda t: t.name)
def test_every_implementation_at_every_bucket_edge(weight_type, impl, kernel_isa):
    # Every path the measured choice may take on some CPU, for every stored type, at every
    # row count where the choice may switch, with bf16 and float32 outputs (amx: AMX tiles
    # where the CPU has them, else the GEMM it falls back to).
    from pagellm.kernels.linear_bindings import LinearImpl, cpu_linear_kernels
    from pagellm.kernels.linear_choice import NUM_BUCKETS, LinearPlan
    from pagellm.model.packable_layers import apply_linear

    if impl == "amx" and kernel_isa != "amx":
        pytest.skip("without AMX tiles the amx kernel is the GEMM, tested as gemm in this build")

    rng = np.random.default_rng(int(weight_type) + 17)
    k, n = (512 if weight_type.block_elements == 32 else 768), 40
    if weight_type is WeightType.BF16:
        w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(torch.bfloat16)
        packed_weight, float_weight, reference = None, w, w.double().numpy()
    elif weight_type is WeightType.I8_ROW:
        part = quantize_int8_rows(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
        packed_weight, float_weight = PackedWeight([part], k), None
        reference = (part.data.view(torch.int8).double() * part.row_scales.double()[:, None]).numpy()
    else:
        data = random_blocks(weight_type, n, k, rng)
        packed_weight, float_weight = PackedWeight([WeightPart(weight_type, packed(weight_type, data, k))], k), None
        reference = reference_weight(weight_type, data, k)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    plan = LinearPlan((LinearImpl[impl.upper()],) * NUM_BUCKETS)
    kernel = cpu_linear_kernels()
    for rows in BUCKET_EDGE_ROWS if weight_type in HAND_KERNEL_TYPES else GENERIC_EDGE_ROWS:
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16)
        # float32 outputs up to 65 rows: past them the GEMM stores the same tiles (65 rows
        # already end in a partial one), and rows 256/257 are most of the test's time.
        for out_dtype in (torch.bfloat16, torch.float32) if rows <= 65 else (torch.bfloat16,):
            with torch.inference_mode():
                y = apply_linear(x, float_weight, packed_weight, bias, kernel, plan, out_dtype)
            assert y.dtype is out_dtype and y.shape == (rows, n)
            _check(y, x, reference, bias.double().numpy())
