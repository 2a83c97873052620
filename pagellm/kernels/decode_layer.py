"""Kernels stage: CPU: the binding of the one-call decoder layer (csrc/decode_layer.c): the
structures it takes, the steps it is chosen for and the caches the native layers read.

The forward paths that call the native layers read the model's layers and the attention
metadata, so they live with the model (model/native/fused_decode.py for this layer,
model/native/layer_ops.py for the layer ops of csrc/layer_ops.c); this module holds what
they share with the C code and with each other, and imports nothing above kernels/.
"""

from __future__ import annotations

import torch

from pagellm.kernels.abi import ExpertForm, Experts, LayerShape, LayerWeights, Scratch, StepInputs
from pagellm.kernels.linear_bindings import LinearImpl

# The structures the layer takes are kernels/abi.py's (checked against the library's).
__all__ = ["ExpertForm", "Experts", "LayerShape", "LayerWeights", "Scratch", "StepInputs"]

# Caches the native layers write and read: bf16, or fp8 (stored rounded and saturated
# in C as torch's path does, read by the attention kernel's fp8 path).
CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

# Up to here one native call per layer beats model/native/layer_ops.py's nine (measured on
# SmolLM2 decode steps, median step time, this layer / layer ops: 12 rows 13.9 / 14.3
# ms, 20 rows 20.4 / 20.5, 24 rows 21.9 / 20.8, 28 rows 24.6 / 22.4, 48 rows 38.0 / 34.0:
# beyond ~20 rows its serial norm and rotary stages cost more than the calls it saves).
MAX_ROWS = 20
# Positions of one request it takes (a speculative verification's k + 1): each row reads
# the request's whole context, so a longer prefill chunk is left to the layer ops (layer_ops.py),
# whose attention reads the context once for all of a request's rows.
MAX_ROWS_PER_REQUEST = 8
# csrc/kernels.h: steps of up to this many rows may give each thread whole experts.
EXPERTS_PER_THREAD_MAX_ROWS = 32


def data_ptr_or_null(tensor: torch.Tensor | None) -> int | None:
    """A tensor as a pointer argument of the native layers (None passes NULL)."""
    return None if tensor is None else tensor.data_ptr()


def qk_norms(attention: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An attention module's per-head q and k norm weights (Qwen3), or (None, None)."""
    if not hasattr(attention, "q_norm"):
        return None, None
    return attention.q_norm.weight, attention.k_norm.weight


def native_impl(linear: torch.nn.Module, rows: int) -> int | None:
    """The native kernel (LinearImpl) a linear layer is planned on at `rows` rows; None
    where its plan chose oneDNN, which only Python can call."""
    impl = LinearImpl.BY_ROWS if linear.plan is None else linear.plan.choose(rows)
    return int(impl) if impl.native else None


def expert_kernel_table(gate_up: torch.nn.Module, down: torch.nn.Module, most_rows: int) -> torch.Tensor:
    """The kernels of a layer's experts at each row count 0..most_rows, as csrc/moe_experts.c
    reads them: int32 [(most_rows + 1) * 2], gate_up's at [2 * rows] and down's at
    [2 * rows + 1], -1 where that projection is planned on oneDNN. Every expert of a layer
    shares one plan per projection (NativeExperts.supports), so one table serves them all."""
    table = [0, 0]
    for rows in range(1, most_rows + 1):
        table += [-1 if impl is None else impl for impl in (native_impl(gate_up, rows), native_impl(down, rows))]
    return torch.tensor(table, dtype=torch.int32)
