"""Attention sinks (gpt-oss) in every backend against a dense float64 reference.

Each head's softmax has one more logit, the head's learned sink, in its denominator; it
weighs no value row. The sinks here are of the scores' size (some above every score, some
far below), so a backend that drops them, or lets them weigh a value row, is far off.
Decodes, a whole prompt (the causal path), a chunk over a cached context, a sliding window
and, for the CPU kernel, every build and both query types cover each backend's paths.
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

QUERY_LENS = [1, 1, 30, 9, 1, 1, 3]
CONTEXT_LENS = [5, 40, 30, 70, 64, 3, 20]
SINKS = torch.tensor([2.5, -1.0, 0.3, -30.0, 1.0, 6.0, -0.5, 0.0])  # one per query head


def _check(backend, dtype, tolerance, window=None):
    gen = torch.Generator().manual_seed(5)
    # head_dim 64: the AVX-512 BF16 item exists for it; 8 query heads over 2 KV heads
    q, k, v, cache, metadata = random_step(gen, 8, 2, 64, 8, QUERY_LENS, CONTEXT_LENS, dtype)
    TorchAttentionBackend().forward(q, k, v, cache, metadata, 1.0)  # the step's K/V into the cache
    metadata.backend_plan = None
    scale = 2 / math.sqrt(q.shape[-1])
    sinks = SINKS.to(dtype)
    expected = dense_attention(q, cache, metadata, scale, window, sinks=sinks)
    plain = dense_attention(q, cache, metadata, scale, window)
    assert (expected - plain).abs().max() > 20 * tolerance, "the sinks must change the result"
    actual = backend.forward(q, k, v, cache, metadata, scale, window, None, sinks)
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance)
    metadata.backend_plan = None  # the same step in a layer without sinks is plain attention
    torch.testing.assert_close(backend.forward(q, k, v, cache, metadata, scale, window).double(), plain,
                               rtol=tolerance, atol=tolerance)  # fmt: skip


@pytest.mark.parametrize("window", [None, 11])
def test_torch_backend(window):
    _check(TorchAttentionBackend(), torch.float32, 1e-5, window)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 11])
def test_cpu_kernel(kernel_isa, dtype, tolerance, window):
    """Every kernel build the host runs; bf16 queries without a window take the AVX-512 BF16
    item where the build has it (several rows of one request in one item: the prompt chunks)."""
    _check(CpuAttentionBackend(native.load_kernels()), dtype, tolerance, window)


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")
    from pagellm.attention.triton_backend import TritonAttentionBackend, TritonTuning

    _check(TritonAttentionBackend(TritonTuning(prefill_block_m=16, block_n=16)), torch.float32, 1e-4)
    _check(TritonAttentionBackend(TritonTuning(prefill_block_m=16, block_n=16, num_splits=4)), torch.float32, 1e-4, 11)
