"""CPU attention kernel: decode rows read from the paged cache in place must give what
the reference path gives (float32 to rounding, bfloat16 within bf16 rounding)."""

import logging

import pytest
import torch

from pagellm.kernels import build as native
from pagellm.attention.selector import get_attention_backend
from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.bench.paged_steps import random_step

kernels = native.load_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler: CPU kernel not built")


def _both_backends(step, scale):
    q, k, v, cache, metadata = step
    reference_cache, kernel_cache = cache.clone(), cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, reference_cache, metadata, scale)
    metadata.backend_plan = None
    actual = CpuAttentionBackend(kernels).forward(q, k, v, kernel_cache, metadata, scale)
    assert torch.equal(reference_cache, kernel_cache)  # same K/V written to the same slots
    return expected, actual


@needs_kernels
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    # head_dim 12: not a multiple of 8, the scalar item (the others: paged_decode_avx2.c)
    [(9, 3, 64, 16), (4, 4, 16, 4), (8, 2, 128, 16), (6, 1, 32, 8), (6, 2, 12, 8)],
)
def test_kernel_matches_reference_float32(num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim)
    query_lens = [1, 1, 7, 1, 1, 1, 12, 1]
    context_lens = [1, 17, 30, 300, 16, 33, 12, 129]
    step = random_step(gen, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, torch.float32)
    expected, actual = _both_backends(step, head_dim**-0.5)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 16)])
def test_many_decodes_read_whole_rows(num_heads, num_kv_heads, head_dim):
    # Enough decodes that each kernel item covers every kv head of its request.
    gen = torch.Generator().manual_seed(11)
    context_lens = (torch.randint(1, 200, (24,), generator=gen)).tolist()
    step = random_step(gen, num_heads, num_kv_heads, head_dim, 16, [1] * 24 + [9], context_lens + [40], torch.float32)
    expected, actual = _both_backends(step, head_dim**-0.5)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_kernel_matches_reference_bfloat16():
    gen = torch.Generator().manual_seed(7)
    for context_lens in ([1, 2, 15, 16, 17, 250], [3, 70, 16, 33, 1, 8, 129, 64, 90, 12]):
        query_lens = [1] * len(context_lens) + [5]
        step = random_step(gen, 9, 3, 64, 16, query_lens, context_lens + [40], torch.bfloat16)
        expected, actual = _both_backends(step, 0.125)
        # Both round scores/probabilities differently; bf16 has 8 significant bits.
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_build_matches_reference(kernel_isa, dtype):
    # The attention kernels of each build the host executes (the AVX-512 BF16 path for bf16
    # head_dim 64/128 exists only in the builds that have it).
    build_kernels = native.load_kernels()
    gen = torch.Generator().manual_seed(3)
    for num_heads, num_kv_heads, head_dim in [(9, 3, 64), (8, 2, 128), (4, 4, 16)]:
        context_lens = [1, 17, 30, 300, 16, 129]
        step = random_step(gen, num_heads, num_kv_heads, head_dim, 16, [1] * 6 + [7], context_lens + [40], dtype)
        q, k, v, cache, metadata = step
        reference_cache, kernel_cache = cache.clone(), cache.clone()
        expected = TorchAttentionBackend().forward(q, k, v, reference_cache, metadata, head_dim**-0.5)
        metadata.backend_plan = None
        actual = CpuAttentionBackend(build_kernels).forward(q, k, v, kernel_cache, metadata, head_dim**-0.5)
        assert torch.equal(reference_cache, kernel_cache)
        tolerance = 1e-5 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)


def _dense_decode_reference(q, cache, metadata, rows, scale):
    """float64 softmax(q k^T) v of each decode row over its context, read from the cache."""
    num_heads, num_kv_heads = q.shape[1], cache.shape[3]
    out = torch.empty(len(rows), num_heads, q.shape[2], dtype=torch.float64)
    for index, (row, length) in enumerate(zip(rows, metadata.seq_lens, strict=True)):
        table = metadata.block_tables[index].tolist()
        keys = torch.cat([cache[0, b] for b in table]).double()[:length]
        values = torch.cat([cache[1, b] for b in table]).double()[:length]
        for head in range(num_heads):
            kv_head = head // (num_heads // num_kv_heads)
            weights = (keys[:, kv_head] @ q[row, head].double() * scale).softmax(0)
            out[index, head] = weights @ values[:, kv_head]
    return out


@needs_kernels
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,num_decodes",
    [
        (9, 3, 64, 16, 3),  # SmolLM2 heads, one kv head per work item
        (9, 3, 64, 16, 24),  # many decodes: whole rows per item
        (32, 8, 128, 16, 2),  # Llama-3-8B heads
        (32, 8, 128, 32, 20),  # blocks of two 16-key chunks
        (14, 2, 64, 8, 5),  # group 7: value heads in chunks of 4 and 3
        (8, 1, 128, 4, 9),  # group 8 at head_dim 128: chunks of 2
        (6, 6, 64, 16, 4),  # no grouping
        (4, 2, 32, 16, 4),  # head_dim without the AVX-512 BF16 item: the AVX2 one
        (16, 1, 64, 16, 3),  # group 16: the AVX2 value pass in two batches of 8 heads
        (4, 2, 20, 16, 4),  # head_dim not a multiple of 8: the scalar item
    ],
)
def test_bfloat16_decode_matches_float64_to_bf16_rounding(num_heads, num_kv_heads, head_dim, block_size, num_decodes):
    # Inputs are bf16 values, so the exact result is known; the kernel computes in float32
    # and rounds once to bf16: it must be within one bf16 step of the exact value.
    gen = torch.Generator().manual_seed(num_heads + head_dim + block_size + num_decodes)
    context_lens = torch.randint(1, 160, (num_decodes,), generator=gen).tolist()
    context_lens[0] = 17  # one past a 16-key chunk
    step = random_step(gen, num_heads, num_kv_heads, head_dim, block_size, [1] * num_decodes, context_lens, torch.bfloat16)
    q, k, v, cache, metadata = step
    scale = head_dim**-0.5
    actual = CpuAttentionBackend(kernels).forward(q, k, v, cache, metadata, scale)
    expected = _dense_decode_reference(q, cache, metadata, range(num_decodes), scale)
    torch.testing.assert_close(actual.double(), expected, rtol=2**-7, atol=1e-4)


@needs_kernels
def test_decode_only_step_against_dense_softmax():
    gen = torch.Generator().manual_seed(3)
    q, k, v, cache, metadata = random_step(gen, 4, 2, 16, 4, [1, 1], [9, 21], torch.float32)
    out = CpuAttentionBackend(kernels).forward(q, k, v, cache, metadata, 0.25)
    for r, (row, length) in enumerate(zip([0, 1], [9, 21])):
        table = metadata.block_tables[r]
        keys = torch.cat([cache[0, b] for b in table.tolist()])[:length]  # [length, kv_heads, dim]
        values = torch.cat([cache[1, b] for b in table.tolist()])[:length]
        for head in range(4):
            kv_head = head // 2
            weights = (keys[:, kv_head] @ q[row, head] * 0.25).softmax(0)
            torch.testing.assert_close(out[row, head], weights @ values[:, kv_head], rtol=1e-5, atol=1e-5)


@needs_kernels
def test_loading_the_kernels_leaves_subnormal_floats_alone():
    # A library linked with -ffast-math would switch the whole process to flush-to-zero.
    import numpy as np

    tiny = np.float32(1e-39)  # subnormal
    assert tiny * np.float32(1.0) != 0
    assert float(torch.tensor(1e-39) * 1.0) != 0


def test_auto_backend_falls_back_without_kernels(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    native.clear_caches()
    try:
        with caplog.at_level(logging.WARNING):
            backend = get_attention_backend("auto")
        assert isinstance(backend, TorchAttentionBackend) and not isinstance(backend, CpuAttentionBackend)
        assert "PyTorch path" in caplog.text
        with pytest.raises(ValueError, match="C compiler"):
            get_attention_backend("cpu")
        monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
        native.clear_caches()
        assert native.load_kernels() is None
    finally:
        native.clear_caches()


def test_reference_backend_on_request_and_unknown_name():
    assert type(get_attention_backend("torch")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


@needs_kernels
def test_auto_backend_is_the_kernel_on_cpu():
    assert isinstance(get_attention_backend("auto", "cpu"), CpuAttentionBackend)
