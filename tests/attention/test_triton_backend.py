"""Triton paged-attention kernels against the reference backend.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports Triton), on small shapes; with CUDA they
run compiled on the GPU (the `gpu` tests at the end).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.attention.triton_backend import (
    TritonAttentionBackend,
    TritonTuning,
    store_kv,
)
from pagellm.bench.paged_steps import random_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles keep the interpreter quick and make each program loop over several key tiles.
SMALL = dict(prefill_block_m=16, block_n=16)


def _to_device(step):
    q, k, v, cache, metadata = step
    moved = AttentionMetadata(
        slot_mapping=metadata.slot_mapping.to(DEVICE),
        block_tables=metadata.block_tables.to(DEVICE),
        query_start_loc=metadata.query_start_loc,
        seq_lens=metadata.seq_lens,
    )
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE), moved


def _compare(step, scale, tuning):
    q, k, v, cache, metadata = _to_device(step)
    reference_cache, kernel_cache = cache.clone(), cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, reference_cache, metadata, scale)
    metadata.backend_plan = None
    actual = TritonAttentionBackend(tuning).forward(q, k, v, kernel_cache, metadata, scale)
    assert torch.equal(reference_cache, kernel_cache)  # same K/V written to the same slots
    return expected, actual


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(4, 2, 16, 4), (6, 2, 32, 16), (3, 3, 64, 8), (8, 1, 128, 16)],
)
def test_mixed_step_matches_reference_float32(num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_heads * 31 + head_dim)
    # Decodes of short and long contexts, a chunk continuing a cached context, a whole
    # prompt, and a chunk longer than one query tile.
    query_lens = [1, 5, 1, 12, 1, 40]
    context_lens = [1, 9, 70, 12, 17, 45]
    step = random_step(gen, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, torch.float32)
    expected, actual = _compare(step, head_dim**-0.5, TritonTuning(**SMALL))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_split_decode_matches_reference(num_splits):
    gen = torch.Generator().manual_seed(num_splits)
    # Contexts shorter than the number of splits leave some slices empty.
    context_lens = [3, 100, 257, 64, 1]
    step = random_step(gen, 8, 2, 32, 16, [1] * 5, context_lens, torch.float32)
    expected, actual = _compare(step, 32**-0.5, TritonTuning(**SMALL, num_splits=num_splits))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_split_decode_alongside_prefill_chunks():
    gen = torch.Generator().manual_seed(5)
    step = random_step(gen, 4, 2, 16, 4, [1, 9, 1], [80, 30, 33], torch.float32)
    expected, actual = _compare(step, 0.25, TritonTuning(**SMALL, num_splits=4))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_rounding(dtype):
    gen = torch.Generator().manual_seed(9)
    step = random_step(gen, 8, 2, 64, 16, [1, 1, 7, 20], [5, 90, 7, 50], dtype)
    expected, actual = _compare(step, 0.125, TritonTuning(**SMALL))
    assert actual.dtype == dtype
    # Both paths accumulate in float32 and round probabilities to the input type.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_decode_against_dense_softmax():
    # Independent of the reference backend: softmax(q k^T) v written out per head.
    gen = torch.Generator().manual_seed(3)
    q, k, v, cache, metadata = _to_device(random_step(gen, 4, 2, 16, 4, [1, 1], [9, 21], torch.float32))
    out = TritonAttentionBackend(TritonTuning(**SMALL)).forward(q, k, v, cache, metadata, 0.25)
    for r, length in enumerate([9, 21]):
        table = metadata.block_tables[r].tolist()
        keys = torch.cat([cache[0, b] for b in table])[:length]
        values = torch.cat([cache[1, b] for b in table])[:length]
        for head in range(4):
            weights = (keys[:, head // 2] @ q[r, head] * 0.25).softmax(0)
            torch.testing.assert_close(out[r, head], weights @ values[:, head // 2], rtol=1e-5, atol=1e-5)


def test_store_kv_skips_negative_slots():
    cache = torch.zeros(2, 3, 4, 2, 16, device=DEVICE)
    key = torch.randn(3, 2, 16, device=DEVICE)
    value = torch.randn(3, 2, 16, device=DEVICE)
    store_kv(key, value, cache, torch.tensor([5, -1, 0], device=DEVICE))
    flat = cache.view(2, 12, 2, 16)
    assert torch.equal(flat[0, 5], key[0]) and torch.equal(flat[1, 0], value[2])
    assert flat[:, [i for i in range(12) if i not in (0, 5)]].abs().sum() == 0


def test_graph_plan_reads_static_buffers():
    # A decode batch padded to a fixed size: its plan is built once; rewriting the
    # buffers' contents must be enough for the next step.
    gen = torch.Generator().manual_seed(1)
    backend = TritonAttentionBackend(TritonTuning(**SMALL))
    seq_lens = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    plan = backend.decode_graph_plan(seq_lens, 4, 2, 16, max_seq_len=512)
    for lengths in ([5, 40, 1], [64, 2, 19]):
        q, k, v, cache, metadata = _to_device(random_step(gen, 4, 2, 16, 4, [1, 1, 1], lengths, torch.float32))
        expected = TorchAttentionBackend().forward(q, k, v, cache.clone(), metadata, 0.25)
        padded_tables = torch.zeros(4, metadata.block_tables.shape[1], dtype=torch.int64, device=DEVICE)
        padded_tables[:3] = metadata.block_tables
        seq_lens.copy_(torch.tensor(lengths + [1], dtype=torch.int32))
        pad = lambda x: torch.cat([x, torch.zeros_like(x[:1])])
        padded = AttentionMetadata(
            slot_mapping=torch.cat([metadata.slot_mapping, torch.tensor([-1], device=DEVICE)]),
            block_tables=padded_tables,
            query_start_loc=[0, 1, 2, 3, 4],
            seq_lens=lengths + [1],
            backend_plan=plan,
        )
        actual = backend.forward(pad(q), pad(k), pad(v), cache, padded, 0.25)[:3]
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_split_heuristic():
    backend = TritonAttentionBackend(TritonTuning(min_decode_programs=256, min_keys_per_split=256, max_splits=32))
    assert backend._decode_splits(num_decodes=256, num_kv_heads=8, max_seq_len=8192) == 1  # enough work
    assert backend._decode_splits(num_decodes=2, num_kv_heads=8, max_seq_len=100) == 1  # too short
    assert backend._decode_splits(num_decodes=2, num_kv_heads=8, max_seq_len=8192) == 16
    assert backend._decode_splits(num_decodes=1, num_kv_heads=1, max_seq_len=1 << 20) == 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_long_context_bf16():
    gen = torch.Generator().manual_seed(0)
    step = random_step(gen, 32, 8, 128, 16, [1] * 4 + [300], [4000, 17, 9000, 600, 900], torch.bfloat16)
    expected, actual = _compare(step, 128**-0.5, TritonTuning())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_kernels_compile_for_an_nvidia_gpu():
    # The interpreter does not check what only the compiler refuses; compile for sm_90.
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "compile_triton_kernels.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    # About a minute cold on one idle core; a busy two-core machine takes several times that
    # (under the suite's per-test limit of 900 s).
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=750)
    if "PTXAS" in result.stderr.upper() and "NOT FOUND" in result.stderr.upper():
        pytest.skip("this Triton build has no ptxas")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all kernels compiled for sm_90" in result.stdout
