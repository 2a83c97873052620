"""Model stage: CPU bf16: the layer ops: steps the one-call decode layer does not take (more rows than it is
chosen for, prefill chunks) run each decoder layer as its four linear layers (each the
implementation measured fastest for the step's rows, kernels/linear_choice.py) plus three
native calls (csrc/layer_ops.c) for everything between them.

The PyTorch path spends about 40 small operations per layer on the norms, rotary
embedding, cache writes, activation and residual adds; at a hundred rows they cost
several milliseconds per step. Per layer here:

    normed = rms_norm(hidden += delta)          native (delta: the previous layer's MLP)
    qkv = normed Wqkv^T (+b)                    linear, float32 out
    rotary(q, k); cache[slot] = k, v            native, q to bf16
    attn = paged attention                      native (CpuAttentionBackend.attend_cached)
    normed = rms_norm(hidden += attn Wo^T (+b)) linear, native
    act = silu(gate) * up of normed Wgu^T       linear, native, act to bf16
    delta = act Wd^T                            linear

Sliding and full layers (gpt-oss, Qwen2 with max_window_layers) each read and write their
own KV cache group (its slots and block tables); attention sinks and soft caps go to the
attention kernel with the layer's window.

A family whose layer differs only inside attention's q and k (Qwen3's per-head q/k
norms: applied in C to the float32 q and k between the qkv projection and rotary) or only
in its MLP (a mixture of experts: the MLP module runs on the bf16 normed rows, its output
widened to float32 as `delta`) runs here too, as in the one-call decode layer.

The residual stream (`hidden`) and every linear output are float32; only the matmuls'
inputs and the KV cache are bf16 (csrc/layer_rows.h), as in the one-call layer. oneDNN
returns bf16, which is widened for the float32 stages.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.kv_cache_dtype import ELEMENT_TYPES
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.kernels.decode_layer import CACHE_DTYPES, data_ptr_or_null, qk_norms
from pagellm.model.layers import RMSNorm
from pagellm.model.native.llama_layer import computes_llama_layers


class NativeLayers:
    """Runs the decoder layers of one bf16 CPU model with native elementwise stages."""

    def __init__(self, library: ctypes.CDLL, model: torch.nn.Module) -> None:
        self._library = library
        self._model = model
        self._num_threads = torch.get_num_threads()
        # Layers whose MLP is an experts' block (called as a module), not a gated MLP.
        self._sparse = [not hasattr(layer.mlp, "gate_up_proj") for layer in model.layers]
        self._num_groups = len(kv_cache_layout(model.config).groups)

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """bf16 weights on the CPU, the native attention kernel, every layer on the global
        rotary table (sliding and full layers alike: each reads its own KV cache group)."""
        config = model.config
        return (
            computes_llama_layers(model)
            and isinstance(model.backend, CpuAttentionBackend)
            and all(p.dtype is torch.bfloat16 and p.device.type == "cpu" and p.is_contiguous() for p in model.parameters())
            and model.local_rotary is None
            and config.rotary_dim == config.head_dim  # the C paths rotate whole heads
            and config.head_dim % 2 == 0
            and config.hidden_activation == "silu"
        )

    @staticmethod
    def applies(kv_caches: list[torch.Tensor]) -> bool:
        """Whether a step over these caches runs here (its embeddings are bf16: every
        parameter is, supports())."""
        return kv_caches[0].dtype in CACHE_DTYPES and kv_caches[0].is_contiguous()

    @staticmethod
    def computes_norm(norm: torch.nn.Module) -> bool:
        """Whether rms_norm() computes this norm (a plain RMSNorm)."""
        return type(norm) is RMSNorm

    def rms_norm(self, hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """bf16 RMSNorm of float32 rows (the final norm), as layer_rows.h rounds it."""
        hidden = hidden.contiguous()
        m, size = hidden.shape
        out = torch.empty(m, size, dtype=torch.bfloat16)
        self._library.rms_norm_residual(
            hidden.data_ptr(), None, norm.weight.data_ptr(), norm.eps, out.data_ptr(), m, size, self._num_threads
        )
        return out

    def run(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size] bf16 embeddings
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float32: the last layer's output, before the final norm
        model, library, threads = self._model, self._library, self._num_threads
        config = model.config
        hidden = hidden.to(torch.float32)
        m, size = hidden.shape
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q_size = heads * head_dim
        positions = positions.contiguous()
        groups = [metadata.for_group(group) for group in range(self._num_groups)]
        slots_of = [group.slot_mapping.contiguous() for group in groups]  # each group's blocks, its own slots
        cos, sin = model.rotary.cos_cache, model.rotary.sin_cache
        normed = torch.empty(m, size, dtype=torch.bfloat16)
        query = torch.empty(m, q_size, dtype=torch.bfloat16)
        act = torch.empty(m, config.intermediate_size, dtype=torch.bfloat16)
        f32 = torch.float32
        delta: torch.Tensor | None = None
        for index, (layer, cache, sparse) in enumerate(zip(model.layers, kv_caches, self._sparse, strict=True)):
            attention, mlp = layer.self_attn, layer.mlp
            rotates = config.layer_rotates(index)  # NULL tables: a NoPE layer
            group = attention.kv_group
            slots = slots_of[group]
            library.rms_norm_residual(
                hidden.data_ptr(), data_ptr_or_null(delta), layer.input_layernorm.weight.data_ptr(),
                layer.input_layernorm.eps, normed.data_ptr(), m, size, threads,
            )  # fmt: skip
            qkv = attention.qkv_proj.compute(normed, f32)
            q_norm, k_norm = qk_norms(attention)
            library.rotary_store(
                qkv.data_ptr(), m, qkv.stride(0), positions.data_ptr(),
                cos.data_ptr() if rotates else None, sin.data_ptr() if rotates else None,
                heads, kv_heads, head_dim, data_ptr_or_null(q_norm), data_ptr_or_null(k_norm), config.rms_norm_eps,
                slots.data_ptr(), query.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(),
                ELEMENT_TYPES[cache.dtype], threads,
            )  # fmt: skip
            attended = model.backend.attend_cached(
                query.view(m, heads, head_dim), cache, groups[group], attention.scale, attention.sliding_window,
                attention.softcap, attention.sinks,
            )  # fmt: skip
            projected = attention.o_proj.compute(attended.view(m, q_size), f32)
            if model.tp is not None:
                projected = model.tp.all_reduce(projected)
            library.rms_norm_residual(
                hidden.data_ptr(), projected.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.eps, normed.data_ptr(), m, size, threads,
            )  # fmt: skip
            if sparse:  # experts (the block all-reduces its own output)
                delta = mlp(normed).to(f32)
                continue
            gate_up = mlp.gate_up_proj.compute(normed, f32)
            library.silu_mul_rows(gate_up.data_ptr(), act.data_ptr(), m, config.intermediate_size, threads)
            delta = mlp.down_proj.compute(act, f32)
            if model.tp is not None:
                delta = model.tp.all_reduce(delta)
        if delta is not None:
            hidden += delta
        return hidden


class FinalNorm(Protocol):
    """The layer ops' native final norm (NativeLayers, hybrid_layers.HybridLayers)."""

    def computes_norm(self, norm: torch.nn.Module) -> bool: ...

    def rms_norm(self, hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor: ...


def final_norm(model: torch.nn.Module, hidden: torch.Tensor, dtype: torch.dtype, layer_ops: FinalNorm | None) -> torch.Tensor:
    """The final norm of a native path's float32 residual stream, rounded to `dtype` once
    (in C where the layer ops compute that norm and the output is bf16: one call for eight torch ops)."""
    if dtype is torch.bfloat16 and layer_ops is not None and layer_ops.computes_norm(model.norm):
        return layer_ops.rms_norm(hidden, model.norm)
    return model.norm(hidden).to(dtype)
