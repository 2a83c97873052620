"""Model stage: the linear layers and the embedding, on the CPU kernels (pagellm/kernels/)
where they apply and torch everywhere else (float32, other devices, autograd).

A layer's weight is either its float parameter or, once `use_packed` is called, a
`PackedWeight` kept as stored (GGUF quantization blocks, int8 rows); a packed layer has no
`weight` parameter. Which implementation a bf16 call takes is the layer's measured
`plan` (kernels/linear_choice.py) for the call's row count; without one, the native
kernels pick by row count. Where the kernels do not apply, a packed weight is dequantized
for the call (the PyTorch fallback).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.linear_bindings import CpuLinearKernels, LinearImpl
from pagellm.kernels.linear_choice import LinearPlan
from pagellm.kernels.weights import PackedWeight, bf16_weight


class LinearAdapters(Protocol):
    """Adapters' products added to a layer's output (lora/slots.py LoRASlots: handed to the
    layers by the worker's LoRA manager)."""

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class _DequantizeScratch:
    """Reused buffers for a weight before a oneDNN call: a packed weight dequantized to bf16,
    any weight widened to float32 (a layer's worth at a time, never a second copy of the model)."""

    def __init__(self) -> None:
        self._buffers = {torch.bfloat16: torch.empty(0, dtype=torch.bfloat16), torch.float32: torch.empty(0)}

    def _buffer(self, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        if self._buffers[dtype].numel() < rows * cols:
            self._buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
        return self._buffers[dtype][: rows * cols].view(rows, cols)

    def weight(self, packed: PackedWeight) -> torch.Tensor:  # [out_features, in_features] bf16
        return packed.dequantize(self._buffer(torch.bfloat16, packed.out_features, packed.in_features))

    def float_weight(self, weight: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor:
        bf16 = weight if packed is None else self.weight(packed)
        return self._buffer(torch.float32, *bf16.shape).copy_(bf16)


_SCRATCH = _DequantizeScratch()


def apply_linear(
    x: torch.Tensor,  # [m, k]
    weight: torch.Tensor | None,  # [n, k] float parameter, or None for a packed weight
    packed: PackedWeight | None,
    bias: torch.Tensor | None,
    kernel: CpuLinearKernels | None,
    plan: LinearPlan | None,
    out_dtype: torch.dtype | None = None,  # None: x's dtype
) -> torch.Tensor:  # [m, n]
    """x W^T (+ b) through the implementation chosen for x's rows. The native kernels
    write float32 outputs directly; oneDNN and torch's fallback give x's dtype, converted."""
    out_dtype = out_dtype or x.dtype
    usable = kernel is not None and (bias is None or bias.is_contiguous())
    if packed is not None:
        usable = usable and kernel.applies_to_rows(x)
    else:
        usable = usable and kernel.applies(x, weight)
    if not usable:
        if packed is not None:
            weight = packed.dequantize().to(x.dtype)
            bias = None if bias is None else bias.to(x.dtype)
        return F.linear(x, weight, bias).to(out_dtype)
    impl = LinearImpl.BY_ROWS if plan is None else plan.choose(x.shape[0])
    if impl is LinearImpl.ONEDNN:
        return F.linear(x, weight if packed is None else _SCRATCH.weight(packed), bias).to(out_dtype)
    if impl is LinearImpl.ONEDNN_F32:
        bias = None if bias is None else bias.float()
        return F.linear(x.float(), _SCRATCH.float_weight(weight, packed), bias).to(out_dtype)
    if packed is not None:
        return packed.linear(x, bias, kernel.num_threads, int(impl), out_dtype)
    return kernel(x, weight, bias, impl, out_dtype)


class PackableLinear(nn.Linear):
    """nn.Linear (same parameters and names), built with the CPU kernels it runs on (None:
    torch); the after-load pass hands it the plan measured for its shape."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, kernel: CpuLinearKernels | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = kernel

    packed: PackedWeight | None = None
    plan: LinearPlan | None = None
    lora: LinearAdapters | None = None  # adapters' room, with --enable-lora (lora/slots.py)
    _kernel_weight: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute(x)

    def compute(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """forward(), with the output in `out_dtype` (float32 for the native layers' residual
        stream); the step's LoRA adapters' products added where the layer has slots."""
        out = apply_linear(x, self.weight, self.packed, self.bias, self.kernel, self.plan, out_dtype)
        return out if self.lora is None else self.lora.add_to(x, out)

    def use_packed(self, packed: PackedWeight) -> None:
        """Keep the weight as stored: the float parameter goes away."""
        self.register_parameter("weight", None)
        self.packed = packed
        self._kernel_weight = None

    def kernel_weight(self) -> PackedWeight:
        """The weight as the native decode layer reads it (bf16 parameters wrapped once)."""
        if self.packed is not None:
            return self.packed
        if self._kernel_weight is None or self._kernel_weight.parts[0].data is not self.weight:
            self._kernel_weight = bf16_weight(self.weight)
        return self._kernel_weight


class PackableEmbedding(nn.Embedding):
    """nn.Embedding whose table may stay as stored (rows dequantized as they are looked up)."""

    packed: PackedWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(ids)
        return self.packed.gather(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)

    def use_packed(self, packed: PackedWeight) -> None:
        self.register_parameter("weight", None)
        self.packed = packed
