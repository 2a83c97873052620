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

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.config.model import ModelConfig
from pagellm.kernels.build import load_kernels
from pagellm.kernels.decode_layer import EXPERTS_PER_THREAD_MAX_ROWS, data_ptr_or_null, expert_kernel_table
from pagellm.model.llama import LlamaForCausalLM, LlamaMLP
from pagellm.model.packable_layers import PackableLinear
from pagellm.model.qwen3 import Qwen3ForCausalLM
from pagellm.model.tensor_parallel import TPGroup


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
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp  # every expert's down_proj is row-parallel: the summed output is all-reduced once
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = PackableLinear(config.hidden_size, config.num_experts, bias=False)  # the router
        # Each expert is a gated MLP of its own width; no all-reduce of its own (tp=None):
        # the block sums the experts first and all-reduces once.
        self.experts = nn.ModuleList(
            LlamaMLP(config, None, config.expert_intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_expert: LlamaMLP | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, None, config.shared_expert_intermediate_size)
            self.shared_expert_gate = PackableLinear(config.hidden_size, 1, bias=False)  # whole on every rank

    native: NativeExperts | None = None  # CPU bf16: the experts in one C call (use_native_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, hidden] -> [rows, hidden]
        weights, experts = route(self.router_logits(x), self.top_k, self.renormalize)
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

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, num_experts] float32
        """The router in float32 whatever the model's dtype: it is small (experts x hidden),
        and the choice it makes is discrete, so a bf16 rounding that reorders two experts
        would send a row to another expert altogether."""
        if x.dtype == torch.float32 or self.gate.weight is None:
            return self.gate(x).float()
        return F.linear(x.float(), self.gate.weight.float())

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


class NativeExperts:
    """A layer's experts through csrc/moe_experts.c: the routing choices sorted by expert
    here, then one call computes every chosen expert over its rows and the weighted sum.
    Its output is float32 (the Python loop sums in the model's dtype)."""

    def __init__(self, library: ctypes.CDLL, block: SparseMoeBlock) -> None:
        self._call = library.moe_experts_bf16
        self._num_threads = torch.get_num_threads()
        experts = list(block.experts)
        self._num_experts = len(experts)
        self._width = experts[0].intermediate_size
        self._hidden = experts[0].down_proj.out_features
        self._weights = [(e.gate_up_proj.kernel_weight(), e.down_proj.kernel_weight()) for e in experts]
        pointers = ctypes.c_void_p * self._num_experts
        self._gate_up = pointers(*(gate_up.struct_address() for gate_up, _ in self._weights))
        self._down = pointers(*(down.struct_address() for _, down in self._weights))
        # Every expert of a layer has the same shape and (from one stacked tensor) type, so
        # one plan per projection serves them all: the kernels by row count, grown as needed.
        self._projections = (experts[0].gate_up_proj, experts[0].down_proj)
        self._kernels = torch.zeros(2, dtype=torch.int32)
        self._scratch_rows = 0

    @staticmethod
    def supports(block: SparseMoeBlock) -> bool:
        """bf16 experts whose linears share one plan per projection (so one kernel choice
        per row count serves every expert)."""
        experts = list(block.experts)
        linears = [linear for e in experts for linear in (e.gate_up_proj, e.down_proj)]
        return (
            all(linear.kernel is not None and linear.bias is None for linear in linears)
            and all(e.gate_up_proj.plan is experts[0].gate_up_proj.plan for e in experts)
            and all(e.down_proj.plan is experts[0].down_proj.plan for e in experts)
            and not any(e.gelu for e in experts)
            and all(p.dtype is torch.bfloat16 for e in experts for p in e.parameters())
        )

    def run(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """[rows, hidden] float32, or None where a chosen expert's row count is planned on
        oneDNN (the caller's loop runs that step)."""
        if x.dtype is not torch.bfloat16 or not x.is_contiguous():
            return None
        m, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self._num_experts)
        most = int(counts.max())
        if 2 * (most + 1) > self._kernels.numel():
            self._kernels = expert_kernel_table(*self._projections, max(most, self._kernels.numel()))
        if bool((self._kernels.view(-1, 2)[counts].min(dim=1).values < 0).any()):
            return None
        offsets = torch.zeros(self._num_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        rows = (order // top_k).contiguous()
        scales = weights.reshape(-1)[order].to(torch.float32).contiguous()
        if most > self._scratch_rows:
            self._scratch_rows = most
            self._scratch = (
                torch.empty(most, self._hidden, dtype=torch.bfloat16),
                torch.empty(most, 2 * self._width, dtype=torch.float32),
                torch.empty(most, self._width, dtype=torch.bfloat16),
                torch.empty(most, self._hidden, dtype=torch.float32),
            )
        out = torch.empty(m, self._hidden, dtype=torch.float32)
        # Few rows: the C code may give each thread whole experts, summing per-thread partials.
        partials = torch.empty(self._num_threads, m, self._hidden) if m <= EXPERTS_PER_THREAD_MAX_ROWS else None
        self._call(
            x.data_ptr(), m, self._hidden, self._width, self._num_experts,
            ctypes.addressof(self._gate_up), ctypes.addressof(self._down),
            offsets.data_ptr(), rows.data_ptr(), scales.data_ptr(), self._kernels.data_ptr(),
            out.data_ptr(), *(buffer.data_ptr() for buffer in self._scratch), data_ptr_or_null(partials),
            self._num_threads,
        )  # fmt: skip
        return out


class _MixtureOfExperts:
    """What a family with sparse layers changes: its MLPs. On the CPU the one-call decode
    layer routes and runs the experts in C (model/fused_decode.py); the layer ops call the
    experts' block as a module, whose experts run in one C call (NativeExperts)."""

    def use_cpu_kernels(self, kernel: object) -> None:
        super().use_cpu_kernels(kernel)  # type: ignore[misc]
        library = load_kernels()
        if library is not None:
            self.use_native_experts(library)

    def use_native_experts(self, library: ctypes.CDLL) -> None:
        """CPU bf16, once the linear plans are measured: each sparse layer's experts in one C call."""
        for module in self.modules():  # type: ignore[attr-defined]
            if isinstance(module, SparseMoeBlock) and NativeExperts.supports(module):
                module.native = NativeExperts(library, module)

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, layer: int) -> nn.Module:
        return SparseMoeBlock(config, tp) if config.is_sparse_layer(layer) else LlamaMLP(config, tp)


class MixtralForCausalLM(_MixtureOfExperts, LlamaForCausalLM):
    pass


class Qwen3MoeForCausalLM(_MixtureOfExperts, Qwen3ForCausalLM):
    pass


class Qwen2MoeForCausalLM(_MixtureOfExperts, LlamaForCausalLM):
    """Qwen2's attention (q/k/v biases) with routed experts and a shared one."""
