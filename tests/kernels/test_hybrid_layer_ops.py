"""csrc/hybrid_layer_ops.c: the elementwise stages of Qwen3.5's layers against the model's own
PyTorch modules (model/qwen3_5.py, model/layers.py) in float32, on every kernel build this
CPU runs. Each output is bf16 rounded once from float32, so it must be within one rounding
(bf16's unit roundoff, 2^-8 relative) of the float32 reference, and whatever is stored elsewhere
(the KV cache, the residual stream) exactly where it belongs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.attention.kv_cache_dtype import ELEMENT_TYPES
from pagellm.kernels.build import load_kernels
from pagellm.model.layers import OffsetRMSNorm, RotaryEmbedding, apply_rotary
from pagellm.model.qwen3_5 import GatedRMSNorm

THREADS = 2


def _library(kernel_isa: str):  # noqa: ANN202
    library = load_kernels()
    assert library is not None and library.isa_level.name == kernel_isa
    return library


def assert_one_rounding(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """bf16 `ours` is `reference` (float32) rounded once: within half a spacing, at most
    2^-8 of the value (8 significant bits)."""
    assert ours.dtype is torch.bfloat16
    torch.testing.assert_close(ours.float(), reference, rtol=2.0**-8, atol=1e-6)


def test_scaled_norm_adds_the_residual_and_scales_by_one_plus_w(kernel_isa):
    library = _library(kernel_isa)
    g = torch.Generator().manual_seed(0)
    m, h = 5, 96
    hidden, delta = torch.randn(m, h, generator=g), torch.randn(m, h, generator=g)
    norm = OffsetRMSNorm(h, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(-0.3, 0.3, generator=g)
    expected_hidden = hidden + delta
    expected = norm(expected_hidden)
    scale = (1.0 + norm.weight.detach()).contiguous()
    out = torch.empty(m, h, dtype=torch.bfloat16)
    library.scaled_rms_norm_residual(hidden.data_ptr(), delta.data_ptr(), scale.data_ptr(), 1e-6, out.data_ptr(), m, h, THREADS)
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=0)
    assert_one_rounding(out, expected)
    # Without a delta the stream stays as it is.
    before = hidden.clone()
    library.scaled_rms_norm_residual(hidden.data_ptr(), None, scale.data_ptr(), 1e-6, out.data_ptr(), m, h, THREADS)
    assert torch.equal(hidden, before)
    assert_one_rounding(out, norm(before))


def test_gated_norm_normalizes_each_value_head_and_gates_by_silu_z(kernel_isa):
    library = _library(kernel_isa)
    g = torch.Generator().manual_seed(1)
    m, heads, dim, extra = 3, 4, 16, 7
    core = torch.randn(m, heads, dim, generator=g) * 3
    projection = torch.randn(m, heads * dim + extra, generator=g)
    z = projection[:, extra:]  # the gate's columns, strided as in_proj's split hands them
    norm = GatedRMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    expected = norm(core, z.reshape(m, heads, dim)).reshape(m, heads * dim)
    out = torch.empty(m, heads * dim, dtype=torch.bfloat16)
    weight = norm.weight.detach().float().contiguous()
    library.gated_rms_norm_rows(
        core.data_ptr(), z.data_ptr(), projection.stride(0), weight.data_ptr(), 1e-6, out.data_ptr(), m, heads, dim, THREADS
    )
    assert_one_rounding(out, expected)
    # The gate bites: without SiLU(z) the output is something else.
    assert not torch.allclose(out.float(), F.rms_norm(core, (dim,), eps=1e-6).reshape(m, -1) * weight.repeat(heads), atol=0.05)


@pytest.mark.parametrize("rotary_share", [0.25, 1.0], ids=["partial-rotary", "whole-heads"])
def test_gated_query_store_norms_rotates_and_caches_as_the_attention_layer(rotary_share, kernel_isa):
    """q (each head's first half of its q_proj rows), k and v as GatedAttention hands them to
    attention: per-head (1 + w) norms, then rotary on the first rotary_dim values; k and v
    stored at the rows' slots (slot -1 not stored), nothing else of the cache touched."""
    library = _library(kernel_isa)
    g = torch.Generator().manual_seed(2)
    m, heads, kv_heads, head_dim = 4, 4, 2, 32
    rotary_dim = int(head_dim * rotary_share)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(m, 2 * q_size + 2 * kv_size, generator=g)
    positions = torch.tensor([0, 5, 17, 300], dtype=torch.int64)
    slots = torch.tensor([3, -1, 0, 9], dtype=torch.int64)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, rotary_dim=rotary_dim)
    q_norm, k_norm = OffsetRMSNorm(head_dim, 1e-6), OffsetRMSNorm(head_dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.uniform_(-0.3, 0.3, generator=g)
        k_norm.weight.uniform_(-0.3, 0.3, generator=g)
    # The reference: GatedAttention's split and position_qk, in float32.
    query_and_gate, k, v = qkv.split([2 * q_size, kv_size, kv_size], dim=-1)
    q = query_and_gate.view(m, heads, 2 * head_dim)[..., :head_dim]
    q_ref, k_ref = apply_rotary(q_norm(q), k_norm(k.view(m, kv_heads, head_dim)), rotary.lookup(positions, torch.float32))
    key_cache = torch.zeros(12, kv_size, dtype=torch.bfloat16)
    value_cache = torch.zeros(12, kv_size, dtype=torch.bfloat16)
    query = torch.empty(m, q_size, dtype=torch.bfloat16)
    q_scale = (1.0 + q_norm.weight.detach()).contiguous()
    k_scale = (1.0 + k_norm.weight.detach()).contiguous()
    work = qkv.clone()
    library.gated_query_store(
        work.data_ptr(), m, work.stride(0), positions.data_ptr(), rotary.cos_cache.data_ptr(), rotary.sin_cache.data_ptr(),
        heads, kv_heads, head_dim, rotary_dim, q_scale.data_ptr(), k_scale.data_ptr(), 1e-6, slots.data_ptr(),
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), ELEMENT_TYPES[torch.bfloat16], THREADS,
    )  # fmt: skip
    assert_one_rounding(query, q_ref.reshape(m, q_size))
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert_one_rounding(key_cache[slot], k_ref[row].reshape(kv_size))
        assert torch.equal(value_cache[slot], v[row].to(torch.bfloat16))
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert not key_cache[untouched].any() and not value_cache[untouched].any()
    # The gates are left in place for sigmoid_gate_rows.
    gates = lambda t: t[:, : 2 * q_size].view(m, heads, 2 * head_dim)[..., head_dim:]  # noqa: E731
    assert torch.equal(gates(work), gates(qkv))


def test_sigmoid_gate_multiplies_each_head_by_its_gate(kernel_isa):
    library = _library(kernel_isa)
    g = torch.Generator().manual_seed(3)
    m, heads, head_dim, extra = 3, 4, 16, 40
    qkv = torch.randn(m, 2 * heads * head_dim + extra, generator=g)
    attn = torch.randn(m, heads * head_dim, generator=g).to(torch.bfloat16)
    gate = qkv[:, : 2 * heads * head_dim].reshape(m, heads, 2 * head_dim)[..., head_dim:].reshape(m, -1)
    out = torch.empty_like(attn)
    library.sigmoid_gate_rows(attn.data_ptr(), qkv.data_ptr(), qkv.stride(0), m, heads, head_dim, out.data_ptr(), THREADS)
    assert_one_rounding(out, attn.float() * torch.sigmoid(gate))
