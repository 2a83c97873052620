"""fp8 KV caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) in every attention backend.

Each backend, fed an fp8 cache, must compute exactly what it computes on a cache of the
query's dtype holding the fp8-rounded K/V (the widening is exact), and stay within the
error that fp8 storage explains of the run on the unrounded K/V: each stored value is
off by at most half a unit in its last place (relative 2^-4 for e4m3's 3 mantissa bits,
2^-3 for e5m2's 2; an absolute half step in the subnormal range), which moves each score
by at most delta and each output by the bound `_fp8_output_bound` derives from it; the
step's relative (L2) error must stay within the per-element relative bound.
The stores (torch, C, Triton) must all give torch's saturating cast, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.kv_cache_dtype import as_stored, to_cache_dtype
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.bench.paged_steps import random_step
from pagellm.kernels import build as native

kernels = native.load_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler: CPU kernel not built")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ELEMENT_CODE = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
# (mantissa bits, smallest normal exponent) of each format.
FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def _triton_backend():
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")
    from pagellm.attention.triton_backend import TritonAttentionBackend, TritonTuning

    return TritonAttentionBackend(TritonTuning(prefill_block_m=16, block_n=16))


def _backend(name):
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if kernels is None:
            pytest.skip("no C compiler: CPU kernel not built")
        return CpuAttentionBackend(kernels)
    return _triton_backend()


def _step(seed, shape, dtype, query_lens, context_lens):
    num_heads, num_kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cache, metadata = random_step(
        gen, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, torch.float32
    )
    return q.to(dtype), k.to(dtype), v.to(dtype), cache, metadata


def _forward(backend, q, k, v, cache, metadata, scale):
    metadata.backend_plan = None
    return backend.forward(q, k, v, cache, metadata, scale)


# backend, query dtype, (heads, kv heads, head_dim, block size): the CPU cases cover the
# AVX-512 BF16 path (bf16, head_dim 64/128; few and many decodes, value-head chunks of
# 4 and 3) and the generic loop (float32; bf16 at head_dim 32).
CASES = [
    ("torch", torch.float32, (9, 3, 64, 16)),
    ("torch", torch.bfloat16, (8, 2, 128, 16)),
    ("cpu", torch.float32, (9, 3, 64, 16)),
    ("cpu", torch.float32, (6, 1, 32, 8)),
    ("cpu", torch.bfloat16, (9, 3, 64, 16)),
    ("cpu", torch.bfloat16, (8, 2, 128, 16)),
    ("cpu", torch.bfloat16, (14, 2, 64, 8)),
    ("cpu", torch.bfloat16, (4, 2, 32, 16)),
    ("triton", torch.float32, (4, 2, 16, 4)),
    ("triton", torch.float32, (9, 3, 64, 16)),
    ("triton", torch.bfloat16, (8, 2, 64, 16)),
]
QUERY_LENS = [1, 1, 7, 1, 1, 12, 1]
CONTEXT_LENS = [1, 17, 30, 160, 16, 12, 129]


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name,dtype,shape", CASES)
def test_fp8_cache_equals_a_cache_holding_the_rounded_values(name, dtype, shape, fp8):
    backend = _backend(name)
    q, k, v, cache, metadata = _step(sum(shape), shape, dtype, QUERY_LENS, CONTEXT_LENS)
    scale = shape[2] ** -0.5
    fp8_cache = to_cache_dtype(cache, fp8)
    rounded_cache = fp8_cache.to(dtype)
    actual = _forward(backend, q, k, v, fp8_cache, metadata, scale)
    expected = _forward(backend, q, as_stored(k, fp8), as_stored(v, fp8), rounded_cache, metadata, scale)
    assert torch.equal(fp8_cache.to(dtype), rounded_cache)  # the same values stored in the same slots
    # Widening fp8 is exact, so only the order of float32 sums could differ.
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def _fp8_output_bound(q, cache, metadata, scale, fp8, dtype):
    """Per output element, the most that storing K/V in `fp8` can move softmax(q K^T) V.

    Each stored value is off by at most u|x| + a (u = 2^-(mantissa + 1), a = half the
    subnormal step). A score moves by at most delta = scale * sum_d |q_d| (u|k_d| + a), so
    each weight p_i by a factor within e^(+-2 delta) and the output by at most
    e^(2 delta) sum_i p_i (u|v_i| + a) + (e^(2 delta) - 1) sum_i p_i |v_i|. bf16 runs round
    probabilities and the output to bf16 in both runs: 2^-7 sum_i p_i |v_i| more.
    """
    mantissa, min_exponent = FORMAT[fp8]
    u, a = 2.0 ** -(mantissa + 1), 2.0 ** (min_exponent - mantissa - 1)
    slack = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    num_heads, num_kv_heads = q.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    bound = torch.empty(q.shape, dtype=torch.float64)
    starts = metadata.query_start_loc
    for r, seq_len in enumerate(metadata.seq_lens):
        table = metadata.block_tables[r].tolist()
        keys = torch.cat([cache[0, b] for b in table]).double()[:seq_len]
        values = torch.cat([cache[1, b] for b in table]).double()[:seq_len]
        query_len = starts[r + 1] - starts[r]
        for i in range(query_len):
            row, length = starts[r] + i, seq_len - query_len + i + 1
            for head in range(num_heads):
                kh, vh = keys[:length, head // group], values[:length, head // group]
                qh = q[row, head].double()
                probs = (kh @ qh * scale).softmax(0)
                delta = scale * float(((kh.abs() * u + a) * qh.abs()).sum(-1).max())
                grow = math.exp(2 * delta)
                weighted = probs @ vh.abs()
                bound[row, head] = grow * (probs @ (vh.abs() * u + a)) + (grow - 1 + slack) * weighted
    return bound


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name,dtype,shape", CASES)
def test_fp8_cache_within_fp8_rounding_of_the_unrounded_run(name, dtype, shape, fp8):
    backend = _backend(name)
    q, k, v, cache, metadata = _step(sum(shape) + 1, shape, dtype, QUERY_LENS, CONTEXT_LENS)
    scale = shape[2] ** -0.5
    exact_cache = cache.to(dtype)
    expected = _forward(backend, q, k, v, exact_cache, metadata, scale)  # writes the new K/V too
    fp8_cache = to_cache_dtype(cache, fp8)
    actual = _forward(backend, q, k, v, fp8_cache, metadata, scale)
    # Storage error per element: relative 2^-4 (e4m3) / 2^-3 (e5m2), or half a subnormal step.
    mantissa, min_exponent = FORMAT[fp8]
    stored, exact = fp8_cache.double(), exact_cache.double()
    assert bool(((stored - exact).abs() <= exact.abs() * 2.0 ** -(mantissa + 1) + 2.0 ** (min_exponent - mantissa - 1)).all())
    # Every element within the worst case those errors allow...
    bound = _fp8_output_bound(q, exact_cache, metadata, scale, fp8, dtype)
    error = (actual.double() - expected.double()).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    # ...and, the roundings being independent, the step's relative error within the
    # per-element one (measured: 0.030-0.034 for e4m3 against 2^-4, 0.056-0.064 for e5m2
    # against 2^-3).
    relative = float(error.norm() / expected.double().norm())
    assert 0 < relative <= 2.0 ** -(mantissa + 1)


def test_stores_saturate_instead_of_overflowing():
    big = torch.tensor([1000.0, -1e6, 448.0, 460.0, float("inf"), 1e5, -6e4, 57344.0])
    e4m3 = to_cache_dtype(big, torch.float8_e4m3fn).float()
    assert e4m3.tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, 448.0, -448.0, 448.0]
    e5m2 = to_cache_dtype(big, torch.float8_e5m2).float()
    assert e5m2.tolist() == [1024.0, -57344.0, 448.0, 448.0, 57344.0, 57344.0, -57344.0, 57344.0]
    assert bool(big.to(torch.float8_e5m2).float().isinf().any())  # what torch's own cast does


def _all_finite_bf16() -> torch.Tensor:
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return values[values.isfinite()]


@needs_kernels
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_c_conversion_matches_torch_on_every_finite_bf16(fp8):
    # csrc/fp8.h, which decode_layer.c and layer_ops.c store through.
    values = _all_finite_bf16()
    out = torch.empty(values.numel(), dtype=torch.uint8)
    kernels.bf16_to_fp8_rows(values.data_ptr(), out.data_ptr(), values.numel(), ELEMENT_CODE[fp8])
    expected = to_cache_dtype(values, fp8).view(torch.uint8)
    mismatched = (out != expected).nonzero().flatten()
    assert mismatched.numel() == 0, values[mismatched[:8]]


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_triton_store_matches_torch_on_every_finite_bf16(fp8, source_dtype):
    # The store kernel rounds with integer operations (the interpreter's fp8 cast is wrong).
    _triton_backend()
    from pagellm.attention.torch_backend import write_kv_to_cache
    from pagellm.attention.triton_backend import store_kv

    # Wide rows (8 heads of 256): the interpreter's cost is per program, one per token.
    values = _all_finite_bf16()
    per_token = 8 * 256
    values = torch.cat([values, values[: -values.numel() % per_token]])  # every value, whole rows
    tokens = values.numel() // per_token
    key = values.to(source_dtype).view(tokens, 8, 256)
    value = -key.flip(0)
    slots = torch.randperm(tokens, generator=torch.Generator().manual_seed(0))
    cache = torch.zeros(2, tokens, 1, 8, 256, dtype=fp8)
    reference = torch.zeros_like(cache)
    store_kv(key, value, cache, slots)
    write_kv_to_cache(key, value, reference, slots)
    assert torch.equal(cache.view(torch.uint8), reference.view(torch.uint8))
