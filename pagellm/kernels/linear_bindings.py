"""Kernels stage: CPU bf16: bindings of the linear layers' native kernels (x86-64 CPUs with AVX2 and up).

Three implementations can compute a bf16 linear layer here, and which is fastest depends
on the CPU and the number of rows, so kernels/linear_choice.py measures them on the
machine at hand:
- STREAMING_INT8 (csrc/quant_int8.c, only when the engine is asked for int8 activations):
  the streaming kernel for Q4_0 / Q4_1 weights with x rounded to int8 per 32 values,
  llama.cpp's arithmetic (AVX-512 VNNI on the weights repacked into its lane order, AVX2's
  byte multiply-adds on the weights as stored); other weights stream as STREAMING;
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
import logging
from collections.abc import Sequence

import torch

from pagellm.kernels.build import load_kernels
from pagellm.kernels.weights import WeightType

logger = logging.getLogger(__name__)

# The weight types csrc/quant_int8.c reads: the VNNI builds the repacked Q4_0 / Q4_1 / MXFP4
# (weights.vnni_part, at load), the K-quants, IQ4_XS and IQ3_S (quant_int8_k.c) and Q8_0
# (quant_int8_q8.c) as stored; the AVX2 builds Q4_0 / Q4_1 / MXFP4 as stored.
INT8_ACTIVATION_TYPES = (WeightType.Q4_0, WeightType.Q4_1, WeightType.Q4_0_VNNI, WeightType.Q4_1_VNNI, WeightType.Q2_K,
                         WeightType.Q3_K, WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K, WeightType.IQ4_XS,
                         WeightType.IQ3_S, WeightType.MXFP4, WeightType.MXFP4_VNNI, WeightType.Q8_0)  # fmt: skip


class LinearImpl(enum.IntEnum):
    """A linear layer's implementation; the native ones' numbers are csrc/kernels.h LINEAR_*."""

    BY_ROWS = 0  # the native kernels' own rule by row count (no measured choice attached)
    STREAMING = 1
    GEMM = 2
    ONEDNN = 3
    AMX = 4
    ONEDNN_F32 = 5
    STREAMING_INT8 = 6

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @property
    def native(self) -> bool:
        return self not in (LinearImpl.ONEDNN, LinearImpl.ONEDNN_F32)


class CpuLinearKernels:
    """The compiled kernels and the thread count to run them with."""

    def __init__(self, library: ctypes.CDLL, num_threads: int, int8_activations: bool = False) -> None:
        self._run = library.linear_bf16
        self._int8_types = {t for t in INT8_ACTIVATION_TYPES if int8_activations and library.quant_int8_supported(int(t))}
        self.num_threads = num_threads
        self.has_amx = bool(library.amx_supported())  # the CPU has AMX-BF16 and Linux granted tile state

    def native_impls(self, weight_types: Sequence[WeightType] = ()) -> tuple[LinearImpl, ...]:
        """The native implementations this machine can run for a weight of these part
        types, in order of preference on a tie (the int8-activation kernel where the
        engine asked for it and a part is of a type it reads)."""
        int8 = (LinearImpl.STREAMING_INT8,) if self._int8_types.intersection(weight_types) else ()
        return (LinearImpl.STREAMING, *int8, LinearImpl.GEMM) + ((LinearImpl.AMX,) if self.has_amx else ())

    @property
    def int8_activations(self) -> bool:
        """Whether the int8-activation kernel is a candidate here (asked for, and this
        build has it)."""
        return bool(self._int8_types)

    @property
    def int8_reads_repacked(self) -> bool:
        """Whether that kernel reads Q4_0 / Q4_1 / MXFP4 repacked into its lane order (the VNNI
        builds), so that the weights must be repacked at load."""
        return WeightType.Q4_0_VNNI in self._int8_types

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


def cpu_linear_kernels(int8_activations: bool = False) -> CpuLinearKernels | None:
    """The kernels where this machine can run them (x86-64 with AVX2, and a C compiler);
    int8_activations: offer the int8-activation kernel where the build has it."""
    library = load_kernels()
    if library is None or not library.linear_bf16_supported():
        return None
    kernels = CpuLinearKernels(library, torch.get_num_threads(), int8_activations)
    if int8_activations and not kernels.int8_activations:
        logger.warning("int8 activations need the native CPU kernels (AVX2 or more): activations stay bf16")
    return kernels
