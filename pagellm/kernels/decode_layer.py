"""Kernels stage: CPU: the binding of the one-call decoder layer (csrc/decode_layer.c): the
structures it takes, the steps it is chosen for and the caches the native layers read.

The forward paths that call the native layers read the model's layers and the attention
metadata, so they live with the model (model/fused_decode.py for this layer,
model/native_layers.py for the layer ops of csrc/layer_ops.c); this module holds what
they share with the C code and with each other, and imports nothing above kernels/.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p

import torch

# Caches the native layers write and read: bf16, or fp8 (stored rounded and saturated
# in C as torch's path does, read by the attention kernel's fp8 path).
CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

# Up to here one native call per layer beats model/native_layers.py's nine (measured on
# SmolLM2 decode steps, median step time, this layer / native_layers: 12 rows 13.9 / 14.3
# ms, 20 rows 20.4 / 20.5, 24 rows 21.9 / 20.8, 28 rows 24.6 / 22.4, 48 rows 38.0 / 34.0:
# beyond ~20 rows its serial norm and rotary stages cost more than the calls it saves).
MAX_ROWS = 20
# Positions of one request it takes (a speculative verification's k + 1): each row reads
# the request's whole context, so a longer prefill chunk is left to native_layers.py,
# whose attention reads the context once for all of a request's rows.
MAX_ROWS_PER_REQUEST = 8


class LayerWeights(ctypes.Structure):
    # qkv, o, gate_up and down point at Weight structures (kernels/weights.py): bf16 or quantized.
    _fields_ = [(name, c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
    )]  # fmt: skip


class LayerShape(ctypes.Structure):
    _fields_ = [
        ("hidden", c_int64), ("intermediate", c_int64),
        ("num_heads", c_int), ("num_kv_heads", c_int), ("head_dim", c_int), ("block_size", c_int),
        ("eps", c_float), ("scale", c_float), ("num_threads", c_int), ("cache_type", c_int),
        ("linear_impl", c_int * 4),  # qkv, o, gate_up, down: kernels/linear_bindings.py LinearImpl (native)
    ]  # fmt: skip


class StepInputs(ctypes.Structure):
    _fields_ = [
        ("m", c_int64), ("positions", c_void_p), ("slots", c_void_p), ("block_tables", c_void_p),
        ("table_stride", c_int64), ("rows", c_void_p), ("reqs", c_void_p), ("seq_lens", c_void_p),
        ("max_seq_len", c_int64), ("cos_table", c_void_p), ("sin_table", c_void_p),
    ]  # fmt: skip


class Scratch(ctypes.Structure):
    _fields_ = [
        (name, c_void_p) for name in ("normed", "qkv", "query", "attn", "proj", "gate_up", "act", "kv_row", "attn_scratch")
    ]


def data_ptr_or_null(tensor: torch.Tensor | None) -> int | None:
    """A tensor as a pointer argument of the native layers (None passes NULL)."""
    return None if tensor is None else tensor.data_ptr()
