"""Model stage: a mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE) and the model classes that use it.

The router scores every expert for every row (in float32), each row keeps its
top-k experts (their weights renormalized to sum to 1 where the family asks), and the
step's rows are then grouped by expert: each expert runs once, as ordinary linear layers
(so the measured CPU kernels, and quantized weights kept as stored, serve experts as they
serve dense layers) over all the rows routed to it, and its outputs, scaled by the
routing weights, are added back to their rows. The loop is over the experts that
received rows, never over tokens. Experts are added in ascending order, as transformers
adds them, so float32 sums round alike. Qwen2-MoE adds a shared expert that every row
takes, scaled by sigmoid of its own one-output gate, after the routed ones.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.config.model import ModelConfig
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.model.llama import LlamaForCausalLM, LlamaMLP
from pagellm.model.packable_layers import PackableLinear
from pagellm.model.qwen3 import Qwen3ForCausalLM
from pagellm.model.tensor_parallel import TPGroup


class ExpertsRunner(Protocol):
    """Runs a block's chosen experts some faster way (model/native/experts.py)."""

    def run(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """[rows, hidden] float32, or None where it does not apply (the block's loop runs)."""
        ...


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [rows, top_k] float32, experts [rows, top_k] int64
    """Each row's top-k experts and their weights (softmax over all experts, in float32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, kernel: CpuLinearKernels | None = None) -> None:
        super().__init__()
        self.tp = tp  # every expert's down_proj is row-parallel: the summed output is all-reduced once
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = PackableLinear(config.hidden_size, config.num_experts, bias=False, kernel=kernel)  # the router
        # Each expert is a gated MLP of its own width; no all-reduce of its own (tp=None):
        # the block sums the experts first and all-reduces once.
        self.experts = nn.ModuleList(
            LlamaMLP(config, None, config.expert_intermediate_size, kernel) for _ in range(config.num_experts)
        )
        self.shared_expert: LlamaMLP | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, None, config.shared_expert_intermediate_size, kernel)
            self.shared_expert_gate = PackableLinear(config.hidden_size, 1, bias=False, kernel=kernel)  # whole on every rank

    # CPU bf16: the experts in one C call (model/native/experts.py), handed over by the
    # after-load pass; None: the loop below.
    native: ExpertsRunner | None = None
    # The top-k taken from the router's logits, then softmaxed (gpt-oss): the same weights as a
    # softmax over all experts renormalized over the top-k, which is how the C router computes it.
    topk_then_softmax = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, hidden] -> [rows, hidden]
        weights, experts = self.route(self.router_logits(x))
        out = None if self.native is None else self.native.run(x, weights, experts)
        if out is None:
            out = self.run_experts(x, weights, experts)
        else:
            out = out.to(x.dtype)
        if self.shared_expert is not None:
            # The gate is the same on every rank, the expert's output a partial sum: the
            # one all-reduce below sums both.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts and their weights ([rows, top_k] float32, int64)."""
        return route(router_logits, self.top_k, self.renormalize)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, num_experts] float32
        """The router in float32 whatever the model's dtype: it is small (experts x hidden),
        and the choice it makes is discrete, so a bf16 rounding that reorders two experts
        would send a row to another expert altogether."""
        if x.dtype == torch.float32 or self.gate.weight is None:
            return self.gate(x).float()
        weight, bias = self._float_router()
        return F.linear(x.float(), weight, bias)

    def _float_router(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The router's weight (and bias, gpt-oss's) in float32, made once per loaded weight:
        converting it on every step cost more than the product."""
        weight = self.gate.weight
        cached = getattr(self, "_router_f32", None)
        if cached is None or cached[0] != weight.data_ptr():
            bias = None if self.gate.bias is None else self.gate.bias.float()
            cached = self._router_f32 = (weight.data_ptr(), weight.float(), bias)
        return cached[1], cached[2]

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts' weighted outputs summed per row, one call per expert over its rows."""
        flat = experts.reshape(-1)  # [rows * top_k]: choice j of row r at r * top_k + j
        order = torch.argsort(flat, stable=True)  # choices grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows_of = order // self.top_k
        scales = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                chosen = rows_of[start : start + count]
                y = expert(x[chosen]) * scales[start : start + count, None].to(x.dtype)
                out.index_add_(0, chosen, y.to(out.dtype))
                start += count
        return out


class MixtureOfExperts:
    """What a family with sparse layers changes: its MLPs."""

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, layer: int, kernel: CpuLinearKernels | None = None) -> nn.Module:
        if config.is_sparse_layer(layer):
            return SparseMoeBlock(config, tp, kernel)
        return LlamaMLP(config, tp, kernel=kernel)


class MixtralForCausalLM(MixtureOfExperts, LlamaForCausalLM):
    pass


class Qwen3MoeForCausalLM(MixtureOfExperts, Qwen3ForCausalLM):
    pass


class Qwen2MoeForCausalLM(MixtureOfExperts, LlamaForCausalLM):
    """Qwen2's attention (q/k/v biases) with routed experts and a shared one."""
