"""Kernels stage: the C boundary in one place: every exported function's signature, and the
ctypes mirror of every structure Python fills (csrc/weights.h, csrc/layer_structs.h).

`declare` gives a loaded library its signatures; `check_layout` compares each mirror's size
and field offsets with the ones the library exports (csrc/abi.c) and refuses a difference
with a KernelABIError naming it, so that a structure changed on one side only can never
have C read the wrong bytes.
"""

from __future__ import annotations

import ctypes
from ctypes import c_char_p, c_float, c_int, c_int32, c_int64, c_void_p
from typing import Any

from pagellm.errors import PagellmError

# csrc/weights.h WEIGHT_MAX_PARTS: stored parts of one fused layer (q, k, v; a Gated
# DeltaNet's qkv, z, b and a).
MAX_PARTS = 4


class KernelABIError(PagellmError):
    """The kernel library's structures differ from their Python mirrors."""


class WeightPart(ctypes.Structure):
    """csrc/weights.h WeightPart: rows of one stored type."""

    _fields_ = [
        ("type", c_int32), ("rows", c_int64), ("row_bytes", c_int64), ("data", c_void_p), ("row_scales", c_void_p),
    ]  # fmt: skip


class Weight(ctypes.Structure):
    """csrc/weights.h Weight: a linear layer's weight, bf16 or stored quantized parts."""

    _fields_ = [("num_parts", c_int32), ("parts", WeightPart * MAX_PARTS)]


class ExpertForm(ctypes.Structure):
    """csrc/layer_structs.h ExpertForm: the experts' biases (arrays of bf16 pointers, or NULL)
    and gpt-oss's clamped SwiGLU (limit 0: silu(gate) * up)."""

    _fields_ = [("gate_up_bias", c_void_p), ("down_bias", c_void_p), ("swiglu_limit", c_float), ("swiglu_alpha", c_float)]


class Experts(ctypes.Structure):
    """A sparse layer's routed experts (csrc/layer_structs.h): the router as float32, each
    expert's gate_up and down Weight*, their kernels by row count, and the shared expert's
    sigmoid gate (float32 [hidden], or NULL)."""

    _fields_ = [
        ("router", c_void_p), ("gate_up", c_void_p), ("down", c_void_p), ("impls", c_void_p),
        ("shared_gate", c_void_p), ("num_experts", c_int64), ("width", c_int64),
        ("top_k", c_int), ("renormalize", c_int), ("router_bias", c_void_p), ("form", ExpertForm),
    ]  # fmt: skip


class LayerWeights(ctypes.Structure):
    # qkv, o, gate_up and down point at Weight structures: bf16 or quantized. gate_up and
    # down are the MLP, a sparse layer's shared expert, or NULL; experts is NULL in a dense layer.
    _fields_ = [(name, c_void_p) for name in (
        "input_norm", "post_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
    )] + [("mlp_width", c_int64), ("experts", ctypes.POINTER(Experts)), ("no_rope", c_int), ("sinks", c_void_p)]  # fmt: skip


class LayerShape(ctypes.Structure):
    _fields_ = [
        ("hidden", c_int64),
        ("num_heads", c_int), ("num_kv_heads", c_int), ("head_dim", c_int), ("block_size", c_int),
        ("eps", c_float), ("scale", c_float), ("num_threads", c_int), ("cache_type", c_int),
        ("linear_impl", c_int * 4),  # qkv, o, gate_up, down: kernels/linear_bindings.py LinearImpl (native)
    ]  # fmt: skip


class StepInputs(ctypes.Structure):
    _fields_ = [
        ("m", c_int64), ("positions", c_void_p), ("slots", c_void_p), ("block_tables", c_void_p),
        ("table_stride", c_int64), ("rows", c_void_p), ("reqs", c_void_p), ("seq_lens", c_void_p),
        ("max_seq_len", c_int64), ("cos_table", c_void_p), ("sin_table", c_void_p), ("key_starts", c_void_p),
    ]  # fmt: skip


class Scratch(ctypes.Structure):
    _fields_ = [
        (name, c_void_p) for name in (
            "normed", "qkv", "query", "attn", "proj", "gate_up", "act", "kv_row", "attn_scratch",
            # sparse layers
            "router_logits", "offsets", "choice_rows", "choice_scales", "gathered", "expert_out", "partials",
            # hybrid layers' Gated DeltaNet
            "mixer_conv", "mixer_core",
        )
    ]  # fmt: skip


class LinearMixer(ctypes.Structure):
    """csrc/layer_structs.h LinearMixer: a Gated DeltaNet's weights (in_proj and out_proj as
    Weight*, the rest float32) and the worker's state slots it updates."""

    _fields_ = [(name, c_void_p) for name in (
        "in_proj", "out_proj", "conv_weight", "a_log", "dt_bias", "norm_weight", "conv_states", "states",
    )] + [(name, c_int64) for name in ("key_heads", "value_heads", "key_dim", "value_dim", "kernel")] + [
        ("tiled", c_int),
    ]  # fmt: skip


class HybridLayer(ctypes.Structure):
    """csrc/layer_structs.h HybridLayer: a Qwen3.5 layer: its LayerWeights (gated attention's
    projections, the MLP or experts), the float32 (1 + w) scales of its norms, its mixer or NULL."""

    _fields_ = [
        ("layer", LayerWeights), ("input_scale", c_void_p), ("post_scale", c_void_p), ("q_scale", c_void_p),
        ("k_scale", c_void_p), ("mixer", ctypes.POINTER(LinearMixer)), ("rotary_dim", c_int),
    ]  # fmt: skip


# Every structure Python fills, by its C name.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "WeightPart": WeightPart, "Weight": Weight, "ExpertForm": ExpertForm, "Experts": Experts, "LayerWeights": LayerWeights,
    "LayerShape": LayerShape, "StepInputs": StepInputs, "Scratch": Scratch, "LinearMixer": LinearMixer,
    "HybridLayer": HybridLayer,
}  # fmt: skip

# name -> (restype, argtypes) of every function Python calls.
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "paged_decode_attention": (None, [
        c_void_p, c_int64,  # query, query row stride
        c_void_p, c_void_p,  # key cache, value cache
        c_void_p, c_int64,  # block tables, table row stride
        c_void_p, c_void_p, c_void_p, c_void_p, c_int64,  # rows, request indices, seq lens, key starts (or NULL), num decodes
        c_int, c_int, c_int, c_int,  # num heads, num kv heads, head dim, block size
        c_float, c_float, c_void_p,  # scale, soft cap (0: none), sinks ([num_heads] float32, or NULL)
        c_int, c_int,  # query/output element type, cache element type (ELEMENT_TYPES)
        c_int, c_int64,  # num threads, max seq len
        c_void_p, c_int64, c_void_p,  # out, out row stride, workspace
    ]),
    "attention_segment_rows": (c_int, []),
    "amx_supported": (c_int, []),
    "linear_bf16_supported": (c_int, []),
    "linear_bf16": (None, [
        c_void_p, c_int64, c_void_p, c_void_p,  # x, x row stride, weight, bias (or None)
        c_void_p, c_int64, c_int,  # out, out row stride, out is float32
        c_int64, c_int64, c_int64, c_int, c_int,  # m, n, k, kernel (csrc/kernels.h LINEAR_*), num threads
    ]),
    # linear.c: Weight* arguments are the Weight structures above.
    "linear_weight": (None, [
        c_void_p, c_int64, c_void_p, c_void_p,  # x, x row stride, Weight*, bias (or None)
        c_void_p, c_int64, c_int,  # out, out row stride, out is float32
        c_int64, c_int64, c_int, c_int,  # m, k, kernel (csrc/kernels.h LINEAR_*), num threads
    ]),
    "quant_type_supported": (c_int, [c_int]),
    "quant_set_codebooks": (None, [c_void_p] * 7),  # iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq4nl (codebooks.py)
    "weight_row_bytes": (c_int64, [c_int, c_int64]),
    "dequantize_rows_bf16": (None, [c_void_p, c_int64, c_int64, c_int64, c_void_p]),  # part*, row0, count, k, out
    "quant_int8_repack": (None, [c_void_p, c_void_p, c_int64, c_int64, c_int64]),  # src, dst, rows, row bytes, k
    "gather_rows_bf16": (None, [c_void_p, c_void_p, c_int64, c_int64, c_void_p]),  # part*, ids, count, k, out
    # hidden, LayerWeights*, key cache, value cache, LayerShape*, StepInputs*, Scratch*
    "decode_layer_bf16": (None, [c_void_p] * 7),
    # hybrid_decode_layer.c: hidden, HybridLayer*, key cache, value cache, LayerShape*, StepInputs*, Scratch*,
    # state slots int64 [m]
    "hybrid_decode_layer_bf16": (None, [c_void_p] * 8),
    # layer_ops.c: the elementwise stages of a layer (model/native/layer_ops.py), float32
    # residual stream, bf16 matmul inputs.
    "rms_norm_residual": (None, [
        c_void_p, c_void_p, c_void_p, c_float,  # hidden float32 (updated), delta float32 or None, weight, eps
        c_void_p, c_int64, c_int64, c_int,  # out bf16, m, hidden size, num threads
    ]),
    "rotary_store": (None, [
        c_void_p, c_int64, c_int64, c_void_p,  # qkv float32, m, row stride, positions
        c_void_p, c_void_p,  # cos, sin tables
        c_int, c_int, c_int,  # num heads, num kv heads, head dim
        c_void_p, c_void_p, c_float,  # q norm, k norm (bf16 [head dim], or None: no q/k norms), their eps
        c_void_p, c_void_p, c_void_p, c_void_p,  # slots, query out (bf16), key cache, value cache
        c_int, c_int,  # cache element type (ELEMENT_TYPES), num threads
    ]),
    # hybrid_layer_ops.c: the elementwise stages of Qwen3.5's layers (model/native/hybrid_layers.py).
    "scaled_rms_norm_residual": (None, [
        c_void_p, c_void_p, c_void_p, c_float,  # hidden float32 (updated), delta float32 or None, scale float32, eps
        c_void_p, c_int64, c_int64, c_int,  # out bf16, m, hidden size, num threads
    ]),
    "gated_rms_norm_rows": (None, [
        c_void_p, c_void_p, c_int64, c_void_p, c_float,  # core float32, z float32, z row stride, weight float32, eps
        c_void_p, c_int64, c_int64, c_int64, c_int,  # out bf16, m, heads, head dim, num threads
    ]),
    "gated_query_store": (None, [
        c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p,  # qkv float32, m, row stride, positions, cos, sin
        c_int, c_int, c_int, c_int,  # num heads, num kv heads, head dim, rotary dim
        c_void_p, c_void_p, c_float,  # q scale, k scale (float32 [head dim]), eps
        c_void_p, c_void_p, c_void_p, c_void_p,  # slots, query out (bf16), key cache, value cache
        c_int, c_int,  # cache element type (ELEMENT_TYPES), num threads
    ]),
    "sigmoid_gate_rows": (None, [
        c_void_p, c_void_p, c_int64, c_int64, c_int, c_int,  # attn bf16, qkv float32, its row stride, m, heads, head dim
        c_void_p, c_int,  # out bf16, num threads
    ]),
    # moe_experts.c: one mixture-of-experts layer's experts (model/native/experts.py).
    "moe_experts_bf16": (None, [
        c_void_p, c_int64, c_int64, c_int64, c_int64,  # x bf16 [m, hidden], m, hidden, expert width, experts
        c_void_p, c_void_p,  # per expert: gate_up Weight*, down Weight* (arrays of pointers)
        c_void_p, c_void_p, c_void_p, c_void_p,  # offsets [experts + 1], rows, scales float32, impls int32 [experts, 2]
        c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,  # out float32, 4 scratch buffers
        c_void_p,  # partials float32 [threads, m, hidden] or None (see moe_experts.c)
        c_void_p, c_void_p, c_float, c_float,  # per expert gate_up / down bias bf16 (arrays of pointers) or None;
        # the clamped SwiGLU's limit (0: silu(gate) * up) and alpha (csrc/kernels.h ExpertForm)
        c_int,  # num threads
    ]),
    # The one-call decode layer's routing (moe_experts.c; tests call it).
    "route_rows": (None, [
        c_void_p, c_int64, c_int64, c_int, c_int,  # logits float32 [m, experts], m, experts, top k, renormalize
        c_void_p, c_void_p, c_void_p,  # out: offsets int64 [experts + 1], rows int64 [m * top k], scales float32
    ]),
    # lora.c: one layer's LoRA products for every adapter of a step (lora/slots.py).
    "lora_add": (c_int, [
        c_void_p, c_int64, c_int, c_void_p, c_int64, c_int,  # x, its row stride, x is float32, out, its row stride, out is float32
        c_void_p, c_void_p, c_int, c_int64, c_int64, c_int64,  # a [slots, ranks, in], b [slots, ranks, n], both bf16 (else float32), ranks, in, n
        c_void_p, c_int64, c_void_p, c_void_p,  # ranges int64 [k, 3], k, pieces int64 [slots, 3, 4], piece counts int32 [slots]
        c_void_p, c_int,  # scratch float32, num threads
    ]),
    # gated_delta.c: a Gated DeltaNet's decode step (attention/gated_delta_decode.py).
    "gated_delta_decode": (None, [
        c_void_p, c_void_p, c_void_p, c_void_p,  # mixed [R, conv dim], b, a [R, value heads], conv weight [conv dim, kernel]
        c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,  # conv states, states, slots int64 [R], A_log, dt_bias
        c_int64, c_int64, c_int64, c_int64, c_int64, c_int64,  # R, key heads, value heads, key dim, value dim, kernel
        c_int, c_void_p, c_void_p, c_int,  # value heads tiled, out [R, value heads, value dim], scratch [R, conv dim], threads
    ]),
    "gated_delta_prefill_run": (None, [
        c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,  # q, k [tokens, heads, key dim], v, g, beta float32
        c_void_p, c_int64, c_int64, c_int64, c_int64,  # state [heads, key dim, value dim] (updated), tokens, heads, dims
        c_void_p, c_int,  # out [tokens, heads, value dim], threads
    ]),
    "causal_conv_run": (None, [
        c_void_p, c_int, c_int64, c_int64, c_int64,  # x [tokens, channels] bf16 or float32 (flag), row stride, tokens, channels
        c_void_p, c_void_p, c_int64, c_void_p, c_int,  # weight [channels, kernel], conv state [channels, kernel - 1], kernel, out, threads
    ]),
    "bf16_to_fp8_rows": (None, [c_void_p, c_void_p, c_int64, c_int]),  # src, dst, n, fp8 element type
    "silu_mul_rows": (None, [c_void_p, c_void_p, c_int64, c_int64, c_int]),  # gate_up f32, act bf16, m, inter, threads
    # logits, dtype, row stride, vocab, bitmask, words, row index, n
    "apply_token_bitmask": (None, [c_void_p, c_int, c_int64, c_int64, c_void_p, c_int64, c_void_p, c_int64]),
}  # fmt: skip


class _AbiEntry(ctypes.Structure):
    _fields_ = [("name", c_char_p), ("value", c_int64)]  # csrc/abi.c AbiEntry


def declare(library: ctypes.CDLL) -> None:
    """Give the library's functions their signatures."""
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    library.abi_entries.restype = ctypes.POINTER(_AbiEntry)
    library.abi_entries.argtypes = []


def library_layout(library: ctypes.CDLL) -> dict[str, int]:
    """{"Struct": size, "Struct.field": offset} as the library was compiled."""
    entries = library.abi_entries()
    layout: dict[str, int] = {}
    index = 0
    while entries[index].name is not None:
        layout[entries[index].name.decode()] = entries[index].value
        index += 1
    return layout


def mirror_layout(structs: dict[str, type[ctypes.Structure]]) -> dict[str, int]:
    """The same, as the ctypes mirrors lay the structures out."""
    layout: dict[str, int] = {}
    for name, struct in structs.items():
        layout[name] = ctypes.sizeof(struct)
        for field_name, *_ in struct._fields_:
            layout[f"{name}.{field_name}"] = getattr(struct, field_name).offset
    return layout


def layout_differences(library: dict[str, int], mirrors: dict[str, int]) -> list[str]:
    """Each way the two layouts differ, for the structures the mirrors describe."""
    structs = {key for key in mirrors if "." not in key}
    found = []
    for key in sorted(set(library) | set(mirrors)):
        if key.split(".")[0] not in structs:
            continue
        what = "size" if "." not in key else "offset"
        if key not in library:
            found.append(f"{key} is in the Python mirror but not in the library")
        elif key not in mirrors:
            found.append(f"{key} is in the library but not in the Python mirror")
        elif library[key] != mirrors[key]:
            found.append(f"{key}: {what} {library[key]} in the library, {mirrors[key]} in the Python mirror")
    return found


def check_layout(library: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] = STRUCTS) -> None:
    """Refuse a library whose structures differ from the mirrors (KernelABIError naming them)."""
    differences = layout_differences(library_layout(library), mirror_layout(structs))
    if differences:
        raise KernelABIError(
            "the kernel library's structures differ from pagellm/kernels/abi.py's mirrors (change both "
            "together: csrc/weights.h, csrc/layer_structs.h): " + "; ".join(differences)
        )
