"""Model stage, CPU: linear layers that stream their weight through a native kernel when
only a few rows pass through them (decode steps of up to 16 requests).

Such a step is bound by reading the weights from memory; csrc/small_linear.c reads each
weight row once and multiplies every activation row into it (eight at a time), where the general GEMM
reaches about half the read bandwidth at this size. Used for bfloat16 weights on CPUs
with AVX-512 BF16; everything else (float32, more rows, GPU) takes torch's F.linear.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

# Beyond this many rows the GEMM library's reuse of each weight tile pays (measured here:
# the kernel is faster up to 16 rows, even at 32, slower at 64).
MAX_ROWS = 16


class SmallBatchKernel:
    """The compiled kernel and the thread count to run it with."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._run = library.small_linear_bf16
        self.num_threads = num_threads

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype is torch.bfloat16
            and weight.dtype is torch.bfloat16
            and x.device.type == "cpu"
            and x.stride(1) == 1
            and weight.is_contiguous()
            and not torch.is_grad_enabled()
        )

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self._run(
            x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), n, m, n, k, self.num_threads,
        )  # fmt: skip
        return out


def small_batch_kernel() -> SmallBatchKernel | None:
    """The kernel where this machine can run it (AVX-512 BF16 and a C compiler)."""
    from pagellm.attention.native import load_kernels

    library = load_kernels()
    if library is None or not library.small_linear_bf16_supported():
        return None
    return SmallBatchKernel(library, torch.get_num_threads())


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: SmallBatchKernel | None
) -> torch.Tensor:
    if kernel is not None and kernel.applies(x, weight) and (bias is None or bias.is_contiguous()):
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


class SmallBatchLinear(nn.Linear):
    """nn.Linear (same parameters and names) that uses the kernel once one is attached."""

    kernel: SmallBatchKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel)
