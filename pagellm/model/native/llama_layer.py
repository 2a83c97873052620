"""Model stage: whether a model's layers are the Llama layer the native paths compute."""

from __future__ import annotations

import torch

from pagellm.model.layers import RMSNorm
from pagellm.model.llama import LlamaAttention, LlamaDecoderLayer
from pagellm.model.qwen3 import Qwen3Attention


def computes_llama_layers(model: torch.nn.Module) -> bool:
    """Every layer runs LlamaDecoderLayer's forward (a family that overrides it, as Gemma's
    sandwich norms do, is not computed natively) with plain RMSNorms, and attention turns q
    and k into what attention reads as Llama does (rotary) or Qwen3 does (a plain RMSNorm
    per head, then rotary). The MLP is gated (SwiGLU: checked on the config by the paths)
    or a mixture of experts."""
    for layer in model.layers:
        if type(layer).forward is not LlamaDecoderLayer.forward:
            return False
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return False
        attention = layer.self_attn
        if type(attention).forward is not LlamaAttention.forward:
            return False
        position_qk = type(attention).position_qk
        if position_qk is Qwen3Attention.position_qk:
            if type(attention.q_norm) is not RMSNorm or type(attention.k_norm) is not RMSNorm:
                return False
        elif position_qk is not LlamaAttention.position_qk:
            return False
    return True
