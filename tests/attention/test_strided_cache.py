"""A layer's K/V as some columns of a wider cache tensor (Gemma 4's narrower layers side by
side, worker/kv_cache.py): every backend writes and reads the view and matches the same
step over a contiguous cache, and leaves the other columns alone."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.bench.paged_steps import random_step
from pagellm.kernels import build as native

QUERY_LENS = [1, 1, 30, 9, 1, 3]
CONTEXT_LENS = [5, 40, 30, 70, 3, 20]


def _strided_copy(cache: torch.Tensor, column: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole tensor, the view): `cache` placed at `column` of a [2, blocks, block_size, width] tensor filled with 7s."""
    two, blocks, block_size, heads, dim = cache.shape
    whole = torch.full((two, blocks, block_size, width), 7.0, dtype=cache.dtype)
    view = whole[..., column : column + heads * dim].unflatten(-1, (heads, dim))
    view.copy_(cache)
    return whole, view


@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
def test_a_strided_view_computes_as_a_contiguous_cache(backend_name, window):
    if backend_name == "cpu":
        backend = CpuAttentionBackend(native.load_kernels())
    elif backend_name == "triton":
        pytest.importorskip("triton")
        from pagellm.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend()
    else:
        backend = TorchAttentionBackend()
    gen = torch.Generator().manual_seed(3)
    q, k, v, cache, metadata = random_step(gen, 4, 2, 16, 8, QUERY_LENS, CONTEXT_LENS, torch.float32)
    whole, view = _strided_copy(cache, 32, 96)
    assert not view.is_contiguous()
    expected = TorchAttentionBackend().forward(q, k, v, cache, metadata, 0.25, window)
    metadata.backend_plan = None
    actual = backend.forward(q, k, v, view, metadata, 0.25, window)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(view, cache)  # the step's K/V written into the view's columns
    assert (whole[..., :32] == 7).all() and (whole[..., 64:] == 7).all()  # the neighbours' columns untouched
