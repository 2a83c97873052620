"""Model stage: Gemma 2 and Gemma 3 (text): the Llama layer with Gemma's numerics.

What differs from Llama, and where it lives:
- RMSNorm scales by (1 + w), in float32 before rounding (layers.OffsetRMSNorm), and each
  layer normalizes both before and after attention and the MLP (GemmaDecoderLayer).
- GeGLU MLP (gelu-tanh), embeddings times sqrt(hidden), the attention scale from
  query_pre_attn_scalar, soft-capping of attention scores and logits (Gemma 2), the
  sliding layers' own rotary base (Gemma 3): ModelConfig fields that the shared Llama
  code reads (model/checkpoint/ fills them).
- Gemma 3 normalizes each head of q and k with GemmaRMSNorm before rotary.
Local sliding-window layers interleave with global ones; the KV cache keeps them in
separate groups (config/kv_layout.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.config.model import ModelConfig
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.model.layers import OffsetRMSNorm as GemmaRMSNorm
from pagellm.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagellm.model.qwen3 import Qwen3Attention
from pagellm.model.tensor_parallel import TPGroup


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Pre- and post-norms around attention and around the MLP ("sandwich" norms)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup | None = None,
        attention_class: type[LlamaAttention] = LlamaAttention,
        mlp: nn.Module | None = None,
        layer: int = 0,
        kernel: CpuLinearKernels | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_class(config, tp, layer, kernel)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp, kernel=kernel) if mlp is None else mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attended = self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, metadata, backend)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q/k norms, with Gemma's (1 + w)."""

    qk_norm_class = GemmaRMSNorm


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_class = Gemma3Attention
