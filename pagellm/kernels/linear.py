"""Kernels, CPU bf16: bindings of the linear layers' native kernels, on CPUs with AVX-512 BF16.

Measured on this machine's two cores against PyTorch's bf16 GEMM (oneDNN):
- up to 16 rows (decode steps of few requests) the time is the time to read the weight;
  csrc/small_linear.c reads each weight row once and multiplies every activation row into
  it, at about twice the bandwidth the GEMM reaches at this size;
- from 17 rows on, csrc/gemm_bf16.c repacks the weight into the dot-product instruction's
  pair layout a panel at a time and computes 6 x 64 register tiles: at 32-64 rows 600-850
  GFLOP/s against PyTorch's 400-650, about even from 512 rows (prefill chunks).
csrc/linear_bf16.c picks between the two by the number of rows (STREAMING_MAX_ROWS in
csrc/kernels.h), for these layers and inside the one-call decode layer alike. float32,
other devices and autograd take torch's F.linear.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.build import load_kernels


class CpuLinearKernels:
    """The compiled kernels and the thread count to run them with."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._run = library.linear_bf16  # picks the kernel by the number of rows
        self.num_threads = num_threads

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.shape[0] > 0
            and x.dtype is torch.bfloat16
            and weight.dtype is torch.bfloat16
            and x.device.type == "cpu"
            and x.stride(1) == 1
            and weight.is_contiguous()
            and not torch.is_grad_enabled()
        )

    def applies_to_rows(self, x: torch.Tensor) -> bool:
        """For a packed weight (kernels/weights.py), which the kernels always read."""
        return (
            x.dim() == 2
            and x.dtype is torch.bfloat16
            and x.device.type == "cpu"
            and x.stride(1) == 1
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


def cpu_linear_kernels() -> CpuLinearKernels | None:
    """The kernels where this machine can run them (AVX-512 BF16 and a C compiler)."""
    library = load_kernels()
    if library is None or not library.linear_bf16_supported():
        return None
    return CpuLinearKernels(library, torch.get_num_threads())
