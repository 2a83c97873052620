"""Model stage: the linear layers and the embedding, on the CPU kernels (pagellm/kernels/)
where they apply and torch everywhere else (float32, other devices, autograd).

A layer's weight is either its float parameter or, once `use_packed` is called, a
`PackedWeight` kept as stored (GGUF quantization blocks, int8 rows); a packed layer has no
`weight` parameter. Where the kernels do not apply, a packed weight is dequantized for
the call (the PyTorch fallback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.linear import CpuLinearKernels
from pagellm.kernels.weights import PackedWeight, bf16_weight


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuLinearKernels | None
) -> torch.Tensor:
    if kernel is not None and kernel.applies(x, weight) and (bias is None or bias.is_contiguous()):
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


def packed_linear(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, kernel: CpuLinearKernels | None
) -> torch.Tensor:
    if kernel is not None and kernel.applies_to_rows(x) and (bias is None or bias.is_contiguous()):
        return packed.linear(x, bias, kernel.num_threads)
    return F.linear(x, packed.dequantize().to(x.dtype), None if bias is None else bias.to(x.dtype))


class CpuLinear(nn.Linear):
    """nn.Linear (same parameters and names) that uses the kernels once they are attached."""

    kernel: CpuLinearKernels | None = None
    packed: PackedWeight | None = None
    _kernel_weight: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, self.kernel)
        return linear(x, self.weight, self.bias, self.kernel)

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


class CpuEmbedding(nn.Embedding):
    """nn.Embedding whose table may stay as stored (rows dequantized as they are looked up)."""

    packed: PackedWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(ids)
        return self.packed.gather(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)

    def use_packed(self, packed: PackedWeight) -> None:
        self.register_parameter("weight", None)
        self.packed = packed
