"""Kernels stage: CPU bf16: bindings of the linear layers' native kernels (x86-64 CPUs with AVX2 and up).

Three implementations can compute a bf16 linear layer here, and which is fastest depends
on the CPU and the number of rows, so kernels/linear_choice.py measures them on the
machine at hand:
- STREAMING (csrc/small_linear.c, quant_linear.c's streaming loops; linear_f32.c's in the
  builds without AVX-512 BF16): reads each weight row once and multiplies every activation
  row into it; decode steps of few rows are bound by reading the weight;
- GEMM (csrc/gemm_bf16.c): repacks the weight a panel at a time (quantized weights are
  dequantized into the panel) and computes 6 x 64 register tiles (linear_f32.c: float32
  panels, 4 x 3 blocks of dot products);
- AMX (csrc/gemm_amx.c, CPUs with AMX-BF16): the GEMM's panels multiplied on AMX tiles;
- ONEDNN: torch's F.linear in bf16, oneDNN underneath (AMX on CPUs that have it, AVX-512
  BF16 elsewhere; without either, torch's bf16 matmul is a scalar loop and loses); a
  quantized weight is dequantized into a scratch buffer for the call;
- ONEDNN_F32: the same in float32 (x widened, the weight widened or dequantized into a
  float32 scratch buffer): where the CPU has no bf16 arithmetic, oneDNN's float32 GEMM.
The native kernels can write float32 outputs (the residual stream, logits); oneDNN gives
bf16. float32 models, other devices and autograd take torch's F.linear.
"""

from __future__ import annotations

import ctypes
import enum

import torch

from pagellm.kernels.build import load_kernels


class LinearImpl(enum.IntEnum):
    """A linear layer's implementation; the native ones' numbers are csrc/kernels.h LINEAR_*."""

    BY_ROWS = 0  # the native kernels' own rule by row count (no measured choice attached)
    STREAMING = 1
    GEMM = 2
    ONEDNN = 3
    AMX = 4
    ONEDNN_F32 = 5

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @property
    def native(self) -> bool:
        return self not in (LinearImpl.ONEDNN, LinearImpl.ONEDNN_F32)


class CpuLinearKernels:
    """The compiled kernels and the thread count to run them with."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._run = library.linear_bf16
        self.num_threads = num_threads
        self.has_amx = bool(library.amx_supported())  # the CPU has AMX-BF16 and Linux granted tile state

    def native_impls(self) -> tuple[LinearImpl, ...]:
        """The native implementations this machine can run, in order of preference on a tie."""
        return (LinearImpl.STREAMING, LinearImpl.GEMM) + ((LinearImpl.AMX,) if self.has_amx else ())

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

    def __call__(
        self,
        x: torch.Tensor,  # [m, k] bf16
        weight: torch.Tensor,  # [n, k] bf16
        bias: torch.Tensor | None,
        impl: LinearImpl = LinearImpl.BY_ROWS,
        out_dtype: torch.dtype = torch.bfloat16,  # or float32
    ) -> torch.Tensor:  # [m, n]
        assert impl.native, "oneDNN is torch's F.linear, not a native kernel"
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=out_dtype)
        self._run(
            x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), n, out_dtype is torch.float32, m, n, k, int(impl), self.num_threads,
        )  # fmt: skip
        return out


def cpu_linear_kernels() -> CpuLinearKernels | None:
    """The kernels where this machine can run them (x86-64 with AVX2, and a C compiler)."""
    library = load_kernels()
    if library is None or not library.linear_bf16_supported():
        return None
    return CpuLinearKernels(library, torch.get_num_threads())
