"""Model stage: CPU bf16: a sparse layer's experts in one native call (csrc/moe_experts.c).

The routing choices are sorted by expert here; then one call computes every chosen
expert over its rows and the weighted sum. The layer ops call the experts' block as a
module, which hands its rows to this runner (SparseMoeBlock.native, set by the
after-load pass); the one-call decode layer routes and runs the experts inside its own
call (fused_decode.py).
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.decode_layer import EXPERTS_PER_THREAD_MAX_ROWS, data_ptr_or_null, expert_kernel_table
from pagellm.model.mixture_of_experts import SparseMoeBlock


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
        # gpt-oss's experts: biases (bf16, as the layer holds them) and the clamped SwiGLU.
        biased = experts[0].gate_up_proj.bias is not None
        self._gate_up_bias = pointers(*(e.gate_up_proj.bias.data_ptr() for e in experts)) if biased else None
        self._down_bias = pointers(*(e.down_proj.bias.data_ptr() for e in experts)) if biased else None
        self._swiglu = (float(getattr(experts[0], "limit", 0.0) or 0.0), float(getattr(experts[0], "alpha", 1.0)))
        self._kernels = torch.zeros(2, dtype=torch.int32)
        self._native_at = [True]  # per row count: both projections on a native kernel (the table's rows, in Python)
        self._scratch_rows = 0

    @staticmethod
    def supports(block: SparseMoeBlock) -> bool:
        """bf16 experts whose linears share one plan per projection (so one kernel choice
        per row count serves every expert), either all with biases or none (gpt-oss's have
        them)."""
        experts = list(block.experts)
        linears = [linear for e in experts for linear in (e.gate_up_proj, e.down_proj)]
        return (
            all(linear.kernel is not None for linear in linears)
            and len({linear.bias is None for linear in linears}) == 1
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
        counted = counts.tolist()
        most = max(counted)
        if 2 * (most + 1) > self._kernels.numel():
            self._kernels = expert_kernel_table(*self._projections, max(most, self._kernels.numel()))
            self._native_at = [min(pair) >= 0 for pair in self._kernels.view(-1, 2).tolist()]
        if not all(self._native_at[count] for count in counted):  # a torch check cost ~6 ops a layer
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
            None if self._gate_up_bias is None else ctypes.addressof(self._gate_up_bias),
            None if self._down_bias is None else ctypes.addressof(self._down_bias),
            *self._swiglu, self._num_threads,
        )  # fmt: skip
        return out
