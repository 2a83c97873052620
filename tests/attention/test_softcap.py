"""Attention-logit soft-capping (Gemma 2) in every backend against a dense reference.

Each scaled score s becomes cap * tanh(s / cap) before the softmax. The cap here (1.5) is
below the scores' spread, so a backend that skips it (or caps after the softmax) is far
off; decodes, a whole prompt (the causal path), a chunk over a cached context, and the
same with a sliding window cover each backend's paths.
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

QUERY_LENS = [1, 1, 30, 9, 1, 1]
CONTEXT_LENS = [5, 40, 30, 70, 64, 3]
CAP = 1.5


def _check(backend, dtype, tolerance, window=None):
    gen = torch.Generator().manual_seed(3)
    q, k, v, cache, metadata = random_step(gen, 4, 2, 64, 8, QUERY_LENS, CONTEXT_LENS, dtype)  # head_dim 64: the bf16 item exists for it
    TorchAttentionBackend().forward(q, k, v, cache, metadata, 1.0)  # the step's K/V into the cache
    metadata.backend_plan = None
    scale = 2 / math.sqrt(q.shape[-1])  # scores of about +-2 and beyond: the cap bites
    expected = dense_attention(q, cache, metadata, scale, window, softcap=CAP)
    uncapped = dense_attention(q, cache, metadata, scale, window)
    assert (expected - uncapped).abs().max() > 20 * tolerance, "the cap must change the result"
    actual = backend.forward(q, k, v, cache, metadata, scale, window, CAP)
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance)
    # The same step without a cap (another layer's) is plain attention again.
    metadata.backend_plan = None
    plain = backend.forward(q, k, v, cache, metadata, scale, window)
    torch.testing.assert_close(plain.double(), uncapped, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [None, 11])
def test_torch_backend(window):
    _check(TorchAttentionBackend(), torch.float32, 1e-5, window)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 11])
def test_cpu_kernel(kernel_isa, dtype, tolerance, window):
    """Every kernel build the host runs (a bf16 query would take the AVX-512 BF16 item
    without the cap: the cap sends it to the float32 loop)."""
    _check(CpuAttentionBackend(native.load_kernels()), dtype, tolerance, window)


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")
    from pagellm.attention.triton_backend import TritonAttentionBackend, TritonTuning

    _check(TritonAttentionBackend(TritonTuning(prefill_block_m=16, block_n=16)), torch.float32, 1e-4)
    _check(TritonAttentionBackend(TritonTuning(prefill_block_m=16, block_n=16, num_splits=4)), torch.float32, 1e-4, 11)
