"""Kernels, CPU: steps of up to 20 tokens (up to 8 per request) run each decoder layer as one native call
(csrc/decode_layer.c) instead of ~50 PyTorch operations.

The native layer treats every token as a decode of its own: row i attends to its
request's context up to and including its own position (positions[i] + 1 tokens), read
through its request's block table. A request with several tokens in the step (the k + 1
positions that verify a speculative proposal, a prefill chunk of <= 8) is thus causal
without a mask, since every row's K/V is stored before any row attends.

At a few tokens per step the layer's arithmetic is tiny and PyTorch's per-operation
dispatch (norms, rotary, splits, activations, residual adds) costs as much as streaming
the weights; the native layer does the same computation with the native linear kernels
and the paged decode attention kernel, keeping the residual stream and the linear
outputs in float32 (only matmul inputs and the KV cache are bf16, csrc/layer_rows.h). Each linear takes
its measured native kernel for the step's rows (kernels/linear_choice.py); a step whose
rows some linear layer is measured faster on oneDNN for goes to native_layers.py, which
can call it. Used for bf16 models on x86-64 CPUs (AVX2 and up); other steps, dtypes and
devices take the PyTorch path.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.kv_cache_dtype import ELEMENT_TYPES
from pagellm.kernels.linear import LinearImpl

# Caches the native layer writes and reads: bf16, or fp8 (stored rounded and saturated
# in C as torch's path does, read by the attention kernel's fp8 path).
_CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

# Up to here one native call per layer beats kernels/native_layers.py's nine (measured on
# SmolLM2 decode steps, median step time, this layer / native_layers: 12 rows 13.9 / 14.3
# ms, 20 rows 20.4 / 20.5, 24 rows 21.9 / 20.8, 28 rows 24.6 / 22.4, 48 rows 38.0 / 34.0:
# beyond ~20 rows its serial norm and rotary stages cost more than the calls it saves).
MAX_ROWS = 20
# Positions of one request it takes (a speculative verification's k + 1): each row reads
# the request's whole context, so a longer prefill chunk is left to native_layers.py,
# whose attention reads the context once for all of a request's rows.
MAX_ROWS_PER_REQUEST = 8


class _LayerWeights(ctypes.Structure):
    # qkv, o, gate_up and down point at Weight structures (kernels/weights.py): bf16 or quantized.
    _fields_ = [(name, c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
    )]  # fmt: skip


class _LayerShape(ctypes.Structure):
    _fields_ = [
        ("hidden", c_int64), ("intermediate", c_int64),
        ("num_heads", c_int), ("num_kv_heads", c_int), ("head_dim", c_int), ("block_size", c_int),
        ("eps", c_float), ("scale", c_float), ("num_threads", c_int), ("cache_type", c_int),
        ("linear_impl", c_int * 4),  # qkv, o, gate_up, down: kernels/linear.py LinearImpl (native)
    ]  # fmt: skip


class _StepInputs(ctypes.Structure):
    _fields_ = [
        ("m", c_int64), ("positions", c_void_p), ("slots", c_void_p), ("block_tables", c_void_p),
        ("table_stride", c_int64), ("rows", c_void_p), ("reqs", c_void_p), ("seq_lens", c_void_p),
        ("max_seq_len", c_int64), ("cos_table", c_void_p), ("sin_table", c_void_p),
    ]  # fmt: skip


class _Scratch(ctypes.Structure):
    _fields_ = [
        (name, c_void_p) for name in ("normed", "qkv", "query", "attn", "proj", "gate_up", "act", "kv_row", "attn_scratch")
    ]


def _longest_query(metadata: AttentionMetadata) -> int:
    starts = metadata.query_start_loc
    return max(starts[r + 1] - starts[r] for r in range(metadata.num_reqs))


def _layer_impls(layer: torch.nn.Module, rows: int) -> tuple[int, int, int, int] | None:
    """The native kernels of a layer's four linears at `rows` rows (None: one is oneDNN)."""
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    impls = [LinearImpl.BY_ROWS if linear.plan is None else linear.plan.choose(rows) for linear in linears]
    return tuple(int(impl) for impl in impls) if all(impl.native for impl in impls) else None


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class FusedDecode:
    """Runs a step of <= MAX_ROWS tokens through the native layer, for one model."""

    def __init__(self, library: ctypes.CDLL, model: torch.nn.Module) -> None:
        config = model.config
        self._run_layer = library.decode_layer_bf16
        self._segment_rows = library.attention_segment_rows()  # attention workspace per thread
        self._model = model
        self._num_threads = torch.get_num_threads()
        self._shape = _LayerShape(
            config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, 0, config.rms_norm_eps,
            config.head_dim**-0.5, self._num_threads, ELEMENT_TYPES[torch.bfloat16],
        )  # fmt: skip
        # The Weight structures live as long as their layers (CpuLinear keeps them).
        self._layers = [
            _LayerWeights(
                _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                layer.self_attn.qkv_proj.kernel_weight().struct_address(), _ptr(layer.self_attn.qkv_proj.bias),
                layer.self_attn.o_proj.kernel_weight().struct_address(), _ptr(layer.self_attn.o_proj.bias),
                layer.mlp.gate_up_proj.kernel_weight().struct_address(),
                layer.mlp.down_proj.kernel_weight().struct_address(),
            )  # fmt: skip
            for layer in model.layers
        ]
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim

        def scratch(width: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.empty(MAX_ROWS, width, dtype=dtype)

        f32 = torch.float32
        self._buffers = [
            scratch(config.hidden_size), scratch(q_size + 2 * kv_size, f32), scratch(q_size), scratch(q_size),
            scratch(config.hidden_size, f32), scratch(2 * config.intermediate_size, f32),
            scratch(config.intermediate_size), scratch(2 * kv_size),
        ]  # fmt: skip
        # Each layer's measured choice per row count (layers of a GGUF may store different
        # types); a row count where some linear of some layer is planned on oneDNN is not
        # taken (None).
        self._impls: list[list[tuple[int, int, int, int]] | None] = [None]
        for rows in range(1, MAX_ROWS + 1):
            per_layer = [_layer_impls(layer, rows) for layer in model.layers]
            self._impls.append(None if any(impls is None for impls in per_layer) else per_layer)
        self._attention_workspace = torch.empty(0, dtype=torch.float32)
        self._rotary = model.rotary

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether the model's shape and weights are what the native layer computes."""
        params = list(model.parameters())
        config = model.config
        return (
            all(p.dtype is torch.bfloat16 and p.device.type == "cpu" and p.is_contiguous() for p in params)
            and config.sliding_window is None
            and config.head_dim % 2 == 0
        )

    def applies(self, hidden: torch.Tensor, kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> bool:
        num_tokens = hidden.shape[0]
        return (
            0 < num_tokens <= MAX_ROWS
            and self._impls[num_tokens] is not None
            and (metadata.num_reqs == num_tokens or _longest_query(metadata) <= MAX_ROWS_PER_REQUEST)
            and hidden.dtype is torch.bfloat16
            and kv_caches[0].dtype in _CACHE_DTYPES
            and kv_caches[0].is_contiguous()
            and metadata.block_tables.dtype is torch.int64
            and metadata.block_tables.is_contiguous()
        )

    def run(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size] bf16 embeddings
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float32, before the final norm
        m = hidden.shape[0]
        rows = torch.arange(m, dtype=torch.int64)
        positions = positions.contiguous()
        if metadata.num_reqs == m:  # decodes: one row per request
            reqs = rows
            seq_lens = torch.tensor(metadata.seq_lens, dtype=torch.int64)
        else:  # each row reads its request's table up to its own position
            starts = metadata.query_start_loc
            reqs = torch.repeat_interleave(
                torch.arange(metadata.num_reqs, dtype=torch.int64),
                torch.tensor([starts[r + 1] - starts[r] for r in range(metadata.num_reqs)]),
            )
            seq_lens = positions.to(torch.int64) + 1
        max_seq_len = max(metadata.seq_lens)
        shape = self._shape
        needed = self._num_threads * max_seq_len * shape.num_heads * self._segment_rows
        if self._attention_workspace.numel() < needed:
            self._attention_workspace = torch.empty(2 * needed, dtype=torch.float32)
        shape.block_size = kv_caches[0].shape[2]
        shape.cache_type = ELEMENT_TYPES[kv_caches[0].dtype]
        tables = metadata.block_tables
        inputs = _StepInputs(
            m, positions.data_ptr(), metadata.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0),
            rows.data_ptr(), reqs.data_ptr(), seq_lens.data_ptr(), max_seq_len,
            self._rotary.cos_cache.data_ptr(), self._rotary.sin_cache.data_ptr(),
        )  # fmt: skip
        scratch = _Scratch(*(b.data_ptr() for b in self._buffers), self._attention_workspace.data_ptr())
        hidden = hidden.to(torch.float32).contiguous()
        hidden_ptr = hidden.data_ptr()
        shape_ref, inputs_ref, scratch_ref = ctypes.byref(shape), ctypes.byref(inputs), ctypes.byref(scratch)
        for weights, cache, impls in zip(self._layers, kv_caches, self._impls[m], strict=True):
            shape.linear_impl = impls
            self._run_layer(
                hidden_ptr, ctypes.byref(weights), cache[0].data_ptr(), cache[1].data_ptr(),
                shape_ref, inputs_ref, scratch_ref,
            )  # fmt: skip
        return hidden
