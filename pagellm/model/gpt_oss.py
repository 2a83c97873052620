"""Model stage: gpt-oss (20b, 120b): Llama's layer with attention sinks and biased, clamped experts.

What differs from Llama, and where it lives:
- Attention: q/k/v/o biases (ModelConfig.attention_bias), a learned sink logit per head in
  every softmax (LlamaAttention.sinks, read by each attention backend), sliding (128) and
  full layers alternating (two KV cache groups, config/kv_layout.py), YaRN rotary.
- Every MLP is a mixture of experts (GptOssMoeBlock): the router has a bias and softmaxes
  its top-k logits; each expert's gate/up and down projections have biases, and its
  SwiGLU is clamped (ClampedSwiGLU). The checkpoint's stacked, transposed experts with
  gate and up interleaved are cut into Llama's per-expert projections at load
  (loader/checkpoint_layouts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.config.model import ModelConfig
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.model.llama import LlamaForCausalLM, LlamaMLP
from pagellm.model.mixture_of_experts import SparseMoeBlock
from pagellm.model.packable_layers import PackableLinear
from pagellm.model.tensor_parallel import TPGroup


class ClampedSwiGLU(LlamaMLP):
    """An expert: gate/up and down projections with biases, and the clamped SwiGLU
    (up clamped to +-limit, plus one; the gate clamped from above, then g * sigmoid(alpha g))."""

    def __init__(self, config: ModelConfig, intermediate_size: int, kernel: CpuLinearKernels | None = None) -> None:
        nn.Module.__init__(self)
        assert config.swiglu_limit is not None
        self.tp = None  # the block all-reduces the experts' sum once
        self.intermediate_size = intermediate_size
        self.gate_up_proj = PackableLinear(config.hidden_size, 2 * intermediate_size, bias=True, kernel=kernel)
        self.down_proj = PackableLinear(intermediate_size, config.hidden_size, bias=True, kernel=kernel)
        self.gelu = False
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoeBlock(SparseMoeBlock):
    """The experts' block: a biased router whose top-k logits are softmaxed, biased experts
    with the clamped SwiGLU, no shared expert."""

    topk_then_softmax = True

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, kernel: CpuLinearKernels | None = None) -> None:
        nn.Module.__init__(self)
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.renormalize = False
        self.gate = PackableLinear(config.hidden_size, config.num_experts, bias=True, kernel=kernel)  # the router
        self.experts = nn.ModuleList(
            ClampedSwiGLU(config, config.expert_intermediate_size, kernel) for _ in range(config.num_experts)
        )
        self.shared_expert = None

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k logits, then a softmax over them (in float32), as transformers routes."""
        top, experts = torch.topk(router_logits.float(), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts


class GptOssForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, layer: int, kernel: CpuLinearKernels | None = None) -> nn.Module:
        return GptOssMoeBlock(config, tp, kernel)
