"""Model stage: the linear layers, on the CPU kernels (pagellm/kernels/linear.py) where
they apply and torch's F.linear everywhere else (float32, other devices, autograd)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.linear import CpuLinearKernels


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuLinearKernels | None
) -> torch.Tensor:
    if kernel is not None and kernel.applies(x, weight) and (bias is None or bias.is_contiguous()):
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


class CpuLinear(nn.Linear):
    """nn.Linear (same parameters and names) that uses the kernels once they are attached."""

    kernel: CpuLinearKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel)
