"""Model stage: Qwen3 (dense): the Llama layer with an RMSNorm over each head of q and k
before rotary, and no q/k/v biases."""

from __future__ import annotations

import torch

from pagellm.config.model import ModelConfig
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.model.layers import RMSNorm, apply_rotary
from pagellm.model.llama import LlamaAttention, LlamaForCausalLM
from pagellm.model.tensor_parallel import TPGroup


class Qwen3Attention(LlamaAttention):
    qk_norm_class: type[RMSNorm] = RMSNorm

    def __init__(
        self, config: ModelConfig, tp: TPGroup | None = None, layer: int = 0, kernel: CpuLinearKernels | None = None
    ) -> None:
        super().__init__(config, tp, layer, kernel)
        # One weight of head_dim, shared by every head (so a tensor-parallel rank keeps it whole).
        self.q_norm = self.qk_norm_class(config.head_dim, config.rms_norm_eps)
        self.k_norm = self.qk_norm_class(config.head_dim, config.rms_norm_eps)

    def position_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(self.q_norm(q), self.k_norm(k), cos_sin)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
