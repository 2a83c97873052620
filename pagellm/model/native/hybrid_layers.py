"""Model stage: CPU bf16: the layer ops of Qwen3.5's hybrid layers (model/qwen3_5.py, dense and
MoE): every step runs each layer as its linear layers (each the implementation measured
fastest for the step's rows, kernels/linear_choice.py), the Gated DeltaNet's own token
mixing (its native decode step or prefill run) and a few native calls
(csrc/hybrid_layer_ops.c) for everything between them.

In PyTorch a hybrid layer is about 150 small operations (norms in float32 and back, splits,
gates, partial rotary, the gated norm): ~3,600 per decode step of a 24-layer model, a third
of a single stream's step. Per layer here:

    normed = rms_norm(hidden += delta) * (1 + w)          native
    linear attention (three layers of four):
      mixed | z | b | a = normed Win^T                    linear, float32 out
      core = conv + gated delta rule on the state slots   GatedDeltaNet.mix
      gated = rms_norm(core) * w * silu(z)                native, bf16
      out = gated Wout^T                                  linear
    gated attention (the fourth):
      q | gate, k, v = normed Wqkv^T                      linear, float32 out
      q, k normed (1 + w), partly rotated; k, v stored    native
      attn = paged attention                              native
      out = (attn * sigmoid(gate)) Wo^T                   native, linear
    normed = rms_norm(hidden += out) * (1 + w)            native
    delta = MLP(normed): gated SiLU, or the experts' block

The residual stream and every linear output are float32; only the matmuls' inputs and the
KV cache are bf16 (csrc/layer_rows.h), as on the Llama layer's native paths. The recurrent
state is float32 whatever the path.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.kv_cache_dtype import ELEMENT_TYPES
from pagellm.kernels.decode_layer import CACHE_DTYPES
from pagellm.model.layers import OffsetRMSNorm
from pagellm.model.llama import LlamaMLP
from pagellm.model.qwen3_5 import GatedAttention, GatedDeltaNet, GatedRMSNorm, HybridDecoderLayer


def offset_scale(norm: torch.nn.Module) -> torch.Tensor:
    """An OffsetRMSNorm's factor 1 + w in float32, as its forward computes it."""
    return (1.0 + norm.weight.detach().float()).contiguous()


class _LayerNorms:
    """A layer's norm factors as the native calls read them (float32), made once at load."""

    def __init__(self, layer: HybridDecoderLayer) -> None:
        self.input = offset_scale(layer.input_layernorm)
        self.post_attention = offset_scale(layer.post_attention_layernorm)
        attention = layer.self_attn
        self.q = None if attention is None else offset_scale(attention.q_norm)
        self.k = None if attention is None else offset_scale(attention.k_norm)
        mixer = layer.linear_attn
        self.gated = None if mixer is None else mixer.norm.weight.detach().float().contiguous()


class HybridLayers:
    """Runs the decoder layers of one bf16 CPU Qwen3.5 model with native elementwise stages."""

    def __init__(self, library: ctypes.CDLL, model: torch.nn.Module) -> None:
        self._library = library
        self._model = model
        self._num_threads = torch.get_num_threads()
        self._norms = [_LayerNorms(layer) for layer in model.layers]
        self._final_scale = offset_scale(model.norm)
        self._eps = model.config.rms_norm_eps
        # The attention layers' caches (a linear-attention layer has none).
        self._attention_layers = [i for i, layer in enumerate(model.layers) if layer.self_attn is not None]

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """bf16 weights on the CPU, Qwen3.5's layers exactly (a subclass overriding a forward
        is not computed here), the native attention kernel, SwiGLU MLPs or experts."""
        config = model.config
        return (
            isinstance(model.backend, CpuAttentionBackend)
            and all(p.dtype is torch.bfloat16 and p.device.type == "cpu" and p.is_contiguous() for p in model.parameters())
            and config.hidden_activation == "silu"
            and config.rotary_dim % 2 == 0
            and type(model.norm) is OffsetRMSNorm
            and all(_computes(layer) for layer in model.layers)
        )

    @staticmethod
    def computes_norm(norm: torch.nn.Module) -> bool:
        """Whether rms_norm() computes this norm (Qwen3.5's 1 + w)."""
        return type(norm) is OffsetRMSNorm

    def rms_norm(self, hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """bf16 OffsetRMSNorm of float32 rows (the final norm), rounded once."""
        hidden = hidden.contiguous()
        m, size = hidden.shape
        out = torch.empty(m, size, dtype=torch.bfloat16)
        self._library.scaled_rms_norm_residual(
            hidden.data_ptr(), None, self._final_scale.data_ptr(), norm.eps, out.data_ptr(), m, size, self._num_threads
        )
        return out

    def applies(self, kv_caches: list[torch.Tensor]) -> bool:
        """Whether a step over these caches runs here (its embeddings are bf16: every
        parameter is, supports())."""
        caches = [kv_caches[i] for i in self._attention_layers]
        return all(cache.dtype in CACHE_DTYPES and cache.is_contiguous() for cache in caches)

    def run(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size] bf16 embeddings
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float32: the last layer's output, before the final norm
        library, threads, eps = self._library, self._num_threads, self._eps
        hidden = hidden.to(torch.float32)
        m, size = hidden.shape
        positions = positions.contiguous()
        normed = torch.empty(m, size, dtype=torch.bfloat16)
        delta: torch.Tensor | None = None
        for layer, cache, norms in zip(self._model.layers, kv_caches, self._norms, strict=True):
            library.scaled_rms_norm_residual(
                hidden.data_ptr(), _pointer(delta), norms.input.data_ptr(), eps, normed.data_ptr(), m, size, threads
            )
            if layer.linear_attn is not None:
                out = self._linear_attention(layer.linear_attn, norms, normed, metadata)
            else:
                out = self._gated_attention(layer.self_attn, norms, normed, positions, cache, metadata)
            library.scaled_rms_norm_residual(
                hidden.data_ptr(), out.data_ptr(), norms.post_attention.data_ptr(), eps, normed.data_ptr(), m, size,
                threads,
            )  # fmt: skip
            delta = self._mlp(layer.mlp, normed)
        if delta is not None:
            hidden += delta
        return hidden

    def _linear_attention(
        self, mixer: GatedDeltaNet, norms: _LayerNorms, normed: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [m, hidden_size] float32
        m = normed.shape[0]
        projected = mixer.in_proj.compute(normed, torch.float32)
        mixed, z, b, a = mixer.split_projection(projected)
        core = mixer.mix(mixed, b, a, metadata).contiguous()
        gated = torch.empty(m, mixer.value_size, dtype=torch.bfloat16)
        assert norms.gated is not None
        self._library.gated_rms_norm_rows(
            core.data_ptr(), z.data_ptr(), projected.stride(0), norms.gated.data_ptr(), mixer.norm.eps,
            gated.data_ptr(), m, mixer.num_value_heads, mixer.value_head_dim, self._num_threads,
        )  # fmt: skip
        out = mixer.out_proj.compute(gated, torch.float32)
        return out if mixer.tp is None else mixer.tp.all_reduce(out)

    def _gated_attention(
        self,
        attention: GatedAttention,
        norms: _LayerNorms,
        normed: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [m, hidden_size] float32
        model, library = self._model, self._library
        m = normed.shape[0]
        heads, head_dim = attention.num_heads, attention.head_dim
        qkv = attention.qkv_proj.compute(normed, torch.float32)
        query = torch.empty(m, heads * head_dim, dtype=torch.bfloat16)
        group = metadata.for_group(attention.kv_group)
        rotary = model.rotary
        assert norms.q is not None and norms.k is not None
        library.gated_query_store(
            qkv.data_ptr(), m, qkv.stride(0), positions.data_ptr(), rotary.cos_cache.data_ptr(),
            rotary.sin_cache.data_ptr(), heads, attention.num_kv_heads, head_dim, 2 * rotary.cos_cache.shape[1],
            norms.q.data_ptr(), norms.k.data_ptr(), attention.q_norm.eps, group.slot_mapping.contiguous().data_ptr(),
            query.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), ELEMENT_TYPES[cache.dtype], self._num_threads,
        )  # fmt: skip
        attended = model.backend.attend_cached(
            query.view(m, heads, head_dim), cache, group, attention.scale, attention.sliding_window
        )
        gated = torch.empty(m, heads * head_dim, dtype=torch.bfloat16)
        library.sigmoid_gate_rows(
            attended.data_ptr(), qkv.data_ptr(), qkv.stride(0), m, heads, head_dim, gated.data_ptr(), self._num_threads
        )
        out = attention.o_proj.compute(gated, torch.float32)
        return out if attention.tp is None else attention.tp.all_reduce(out)

    def _mlp(self, mlp: torch.nn.Module, normed: torch.Tensor) -> torch.Tensor:  # [m, hidden_size] float32
        if not isinstance(mlp, LlamaMLP):  # experts (the block all-reduces its own output)
            return mlp(normed).to(torch.float32)
        m = normed.shape[0]
        gate_up = mlp.gate_up_proj.compute(normed, torch.float32)
        act = torch.empty(m, mlp.intermediate_size, dtype=torch.bfloat16)
        self._library.silu_mul_rows(gate_up.data_ptr(), act.data_ptr(), m, mlp.intermediate_size, self._num_threads)
        delta = mlp.down_proj.compute(act, torch.float32)
        return delta if mlp.tp is None else mlp.tp.all_reduce(delta)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _computes(layer: torch.nn.Module) -> bool:
    """A Qwen3.5 layer as model/qwen3_5.py defines it, with the norms and MLP computed here."""
    if type(layer).forward is not HybridDecoderLayer.forward:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm) is not OffsetRMSNorm for norm in norms):
        return False
    if layer.linear_attn is not None:
        mixer = layer.linear_attn
        if type(mixer).forward is not GatedDeltaNet.forward or type(mixer.norm) is not GatedRMSNorm:
            return False
    else:
        attention = layer.self_attn
        if type(attention).forward is not GatedAttention.forward:
            return False
        if type(attention.q_norm) is not OffsetRMSNorm or type(attention.k_norm) is not OffsetRMSNorm:
            return False
        if attention.softcap is not None:
            return False
    mlp = layer.mlp
    if isinstance(mlp, LlamaMLP):  # the dense MLP exactly (SwiGLU), or else an experts' block called as a module
        return type(mlp) is LlamaMLP and not mlp.gelu
    return True
