"""Sliding-window attention in every backend against a dense reference written here.

A query at position p sees keys p - window + 1 .. p (transformers' sliding mask). Blocks
that lie wholly before every window of a request are filled with NaN first: the KV cache
manager frees them while the request runs and another request may overwrite them, so a
backend that reads them at all (even masked) fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_reference import dense_attention

from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.bench.paged_steps import random_step
from pagellm.kernels import build as native

# Decodes of contexts shorter and longer than the window, a chunk that continues a
# cached context across the window, a whole prompt longer than the window.
QUERY_LENS = [1, 1, 1, 9, 30, 1]
CONTEXT_LENS = [5, 13, 200, 70, 30, 64]


def _poison_unread_blocks(cache, metadata, window):
    """NaN into every block a request's windows never reach (the ones a manager frees)."""
    block_size = cache.shape[2]
    for r, seq_len in enumerate(metadata.seq_lens):
        query_len = metadata.query_start_loc[r + 1] - metadata.query_start_loc[r]
        first_key = max(0, seq_len - query_len - window + 1)
        for index in range(first_key // block_size):
            cache[:, metadata.block_tables[r, index]] = float("nan")


def _step(dtype, window, block_size=8, heads=(6, 2, 32), seed=0):
    gen = torch.Generator().manual_seed(seed)
    step = random_step(gen, *heads, block_size, QUERY_LENS, CONTEXT_LENS, dtype)
    q, k, v, cache, metadata = step
    # The step's own K/V go in first, so the reference sees the whole context.
    TorchAttentionBackend().forward(q, k, v, cache, metadata, 1.0)
    metadata.backend_plan = None
    _poison_unread_blocks(cache, metadata, window)
    return q, k, v, cache, metadata


def _check(backend, dtype, window, tolerance):
    q, k, v, cache, metadata = _step(dtype, window)
    scale = 1 / math.sqrt(q.shape[-1])
    expected = dense_attention(q, cache, metadata, scale, window)
    actual = backend.forward(q, k, v, cache, metadata, scale, window)
    assert torch.isfinite(actual).all(), "a block before the window was read"
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance)
    # Another window in the same step (another layer's) gets its own plan; narrower, so
    # that it reads only blocks the poison spared.
    narrower = max(1, window // 3)
    expected_narrower = dense_attention(q, cache, metadata, scale, narrower)
    actual_narrower = backend.forward(q, k, v, cache, metadata, scale, narrower)
    torch.testing.assert_close(actual_narrower.double(), expected_narrower, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [1, 7, 16, 33])
def test_torch_backend(window):
    _check(TorchAttentionBackend(), torch.float32, window, 1e-5)


kernels = native.load_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler: CPU kernel not built")


@needs_kernels
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [1, 7, 16, 33])
def test_cpu_kernel(window, dtype, tolerance):
    _check(CpuAttentionBackend(kernels), dtype, window, tolerance)


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")
    from pagellm.attention.triton_backend import TritonAttentionBackend, TritonTuning

    for window in (7, 33):
        _check(TritonAttentionBackend(TritonTuning(prefill_block_m=16, block_n=16)), torch.float32, window, 1e-4)
    # Flash-decoding splits start at the window, not at position 0.
    _check(TritonAttentionBackend(TritonTuning(prefill_block_m=16, block_n=16, num_splits=4)), torch.float32, 33, 1e-4)
