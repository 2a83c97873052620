"""Model stage: CPU: steps of up to 20 tokens (up to 8 per request) run each decoder layer as one native call
(kernels/csrc/decode_layer.c) instead of ~50 PyTorch operations.

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
rows some linear layer is measured faster on oneDNN for goes to layer_ops.py, which
can call it. Used for bf16 models on x86-64 CPUs (AVX2 and up); other steps, dtypes and
devices take the PyTorch path.

Qwen3's per-head q/k norms run in C before rotary. A mixture-of-experts layer routes its rows in
C (the router in float32, softmax, top-k, renormalized where the family asks) and runs the
chosen experts inside the same call (csrc/moe_experts.c's stages; at a few rows each thread
takes whole experts); Qwen2-MoE's shared expert is the layer's gated MLP, scaled per row by
the sigmoid of its gate. Measured on a Qwen3-MoE shape as Q4_0 (single stream, Zen 4, 2
threads, interleaved in one process): 183.5 tok/s against 123.7 through the layer ops.

A forward path of the model (it reads the model's layers and the attention metadata);
the C structures it fills and its row limits are the kernel's binding,
kernels/decode_layer.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.kv_cache_dtype import ELEMENT_TYPES
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.config.model import ModelConfig
from pagellm.kernels.decode_layer import (
    CACHE_DTYPES,
    MAX_ROWS,
    MAX_ROWS_PER_REQUEST,
    ExpertForm,
    Experts,
    LayerShape,
    LayerWeights,
    Scratch,
    StepInputs,
    data_ptr_or_null,
    expert_kernel_table,
    native_impl,
    qk_norms,
)
from pagellm.model.layers import RMSNorm
from pagellm.model.native.experts import NativeExperts
from pagellm.model.native.llama_layer import computes_llama_layers


def _longest_query(metadata: AttentionMetadata) -> int:
    starts = metadata.query_start_loc
    return max(starts[r + 1] - starts[r] for r in range(metadata.num_reqs))


def is_sparse(layer: torch.nn.Module) -> bool:
    """Whether a layer's MLP is a mixture of experts (model/mixture_of_experts.py SparseMoeBlock)."""
    return hasattr(layer.mlp, "experts")


def mlp_linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The gated MLP the layer runs over all its rows: its own, a sparse layer's shared expert, or None."""
    mlp = layer.mlp.shared_expert if is_sparse(layer) else layer.mlp
    return None if mlp is None else (mlp.gate_up_proj, mlp.down_proj)


def _layer_impls(layer: torch.nn.Module, rows: int) -> tuple[int, int, int, int] | None:
    """The native kernels of a layer's attention projections and its MLP (a sparse layer's
    shared expert; 0 where it has none) at `rows` rows (None: one is oneDNN)."""
    mlp = mlp_linears(layer)
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *(mlp or ()))
    impls = [native_impl(linear, rows) for linear in linears]
    return None if None in impls else (*impls, 0, 0)[:4]  # type: ignore[return-value]


def _native_expert_rows(table: torch.Tensor) -> int:
    """The most rows up to which every row count an expert may receive has native kernels."""
    pairs = table.view(-1, 2)[1:].tolist()
    for count, pair in enumerate(pairs, start=1):
        if min(pair) < 0:
            return count - 1
    return len(pairs)


class SparseLayer:
    """What the C layer reads of a sparse layer, kept alive as long as the FusedDecode."""

    def __init__(self, block: torch.nn.Module) -> None:
        experts = list(block.experts)
        self.router = block.gate.weight.detach().float().contiguous()
        self.router_bias = None if block.gate.bias is None else block.gate.bias.detach().float().contiguous()
        shared = block.shared_expert is not None
        self.shared_gate = block.shared_expert_gate.weight.detach().float().reshape(-1).contiguous() if shared else None
        pointers = ctypes.c_void_p * len(experts)
        self.gate_up = pointers(*(e.gate_up_proj.kernel_weight().struct_address() for e in experts))
        self.down = pointers(*(e.down_proj.kernel_weight().struct_address() for e in experts))
        self.table = expert_kernel_table(experts[0].gate_up_proj, experts[0].down_proj, MAX_ROWS)
        self.native_rows = _native_expert_rows(self.table)
        self.width = experts[0].intermediate_size
        # gpt-oss's experts: their biases (bf16, as the layers hold them) and the clamped SwiGLU.
        biased = experts[0].gate_up_proj.bias is not None
        self.gate_up_bias = pointers(*(e.gate_up_proj.bias.data_ptr() for e in experts)) if biased else None
        self.down_bias = pointers(*(e.down_proj.bias.data_ptr() for e in experts)) if biased else None
        form = ExpertForm(
            None if self.gate_up_bias is None else ctypes.addressof(self.gate_up_bias),
            None if self.down_bias is None else ctypes.addressof(self.down_bias),
            float(getattr(experts[0], "limit", 0.0) or 0.0), float(getattr(experts[0], "alpha", 1.0)),
        )  # fmt: skip
        self.struct = Experts(
            self.router.data_ptr(), ctypes.addressof(self.gate_up), ctypes.addressof(self.down),
            self.table.data_ptr(), data_ptr_or_null(self.shared_gate), len(experts), self.width,
            block.top_k, int(block.renormalize or block.topk_then_softmax), data_ptr_or_null(self.router_bias), form,
        )  # fmt: skip

    @staticmethod
    def supports(block: torch.nn.Module) -> bool:
        """A float router and shared-expert gate the C code can read, and experts that share one
        plan per projection (so one kernel table serves them all)."""
        return (
            block.gate.weight is not None
            and (block.shared_expert is None or block.shared_expert_gate.weight is not None)
            and NativeExperts.supports(block)
        )


class DecodeScratch:
    """The one-call layers' working memory (csrc/layer_structs.h Scratch) for steps of up to
    MAX_ROWS rows: sized once at load, the attention's workspace grown to a step's longest
    context. Column widths: the layer's projection output (float32), the query, the attention
    output (the wider of q and a mixer's value), the widest MLP or expert, the K/V row; a
    hybrid's Gated DeltaNet also takes its convolved channels and its output (`mixer`)."""

    def __init__(
        self, config: ModelConfig, projection: int, q_size: int, attn_width: int, kv_size: int, mlp_width: int,
        num_threads: int, segment_rows: int, mixer: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        hidden = config.hidden_size
        num_experts = max(config.num_experts, 1)
        top_k = max(config.num_experts_per_tok, 1)

        def rows(columns: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.empty(MAX_ROWS, columns, dtype=dtype)

        f32 = torch.float32
        self._buffers = [
            rows(hidden), rows(projection, f32), rows(q_size), rows(attn_width), rows(hidden, f32),
            rows(2 * mlp_width, f32), rows(mlp_width), rows(2 * kv_size),
        ]  # fmt: skip
        self._moe_buffers = [
            rows(num_experts, f32), torch.empty(num_experts + 1, dtype=torch.int64), rows(top_k, torch.int64),
            rows(top_k, f32), rows(hidden), rows(hidden, f32), rows(num_threads * hidden, f32),
        ]  # fmt: skip
        self._mixer_buffers = [] if mixer is None else [rows(mixer[0], f32), rows(mixer[1], f32)]
        self._workspace_per_context = num_threads * segment_rows  # floats per head and context token
        self._attention_workspace = torch.empty(0, dtype=torch.float32)

    def struct(self, max_seq_len: int, num_heads: int) -> Scratch:
        """The Scratch of a step whose longest context is `max_seq_len` (the workspace grown to it)."""
        needed = self._workspace_per_context * max_seq_len * num_heads
        if self._attention_workspace.numel() < needed:
            self._attention_workspace = torch.empty(2 * needed, dtype=torch.float32)
        return Scratch(
            *(b.data_ptr() for b in self._buffers), self._attention_workspace.data_ptr(),
            *(b.data_ptr() for b in self._moe_buffers), *(b.data_ptr() for b in self._mixer_buffers),
        )  # fmt: skip


def impls_by_rows(
    layers: list[torch.nn.Module], layer_impls: Callable[[torch.nn.Module, int], tuple[int, int, int, int] | None],
    sparse: list[SparseLayer | None],
) -> list[list[tuple[int, int, int, int]] | None]:  # fmt: skip
    """Each layer's measured native kernels per row count 1..MAX_ROWS (index 0 unused; layers
    of a GGUF may store different types); a row count where some linear of some layer is
    planned on oneDNN, or where an expert could receive a row count planned on oneDNN, is
    not taken (None)."""
    expert_rows = min((layer.native_rows for layer in sparse if layer is not None), default=MAX_ROWS)
    table: list[list[tuple[int, int, int, int]] | None] = [None]
    for rows in range(1, MAX_ROWS + 1):
        per_layer = [layer_impls(layer, rows) for layer in layers]
        taken = rows <= expert_rows and all(impls is not None for impls in per_layer)
        table.append(per_layer if taken else None)  # type: ignore[arg-type]
    return table


class FusedDecode:
    """Runs a step of <= MAX_ROWS tokens through the native layer, for one model."""

    def __init__(self, library: ctypes.CDLL, model: torch.nn.Module) -> None:
        config = model.config
        self._run_layer = library.decode_layer_bf16
        self._model = model
        self._num_threads = torch.get_num_threads()
        self._shape = LayerShape(
            config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, 0, config.rms_norm_eps,
            model.layers[0].self_attn.scale, self._num_threads, ELEMENT_TYPES[torch.bfloat16],
        )  # fmt: skip
        # The Weight structures live as long as their layers (PackableLinear keeps them).
        self._sparse = [SparseLayer(layer.mlp) if is_sparse(layer) else None for layer in model.layers]
        # gpt-oss's sinks, float32 as the attention kernel reads them (kept alive here).
        self._sinks = [None if layer.self_attn.sinks is None else layer.self_attn.sinks.detach().float().contiguous()
                       for layer in model.layers]  # fmt: skip
        self._layers = []
        widths = [1]
        for index, (layer, sparse) in enumerate(zip(model.layers, self._sparse, strict=True)):
            attention, mlp = layer.self_attn, mlp_linears(layer)
            q_norm, k_norm = qk_norms(attention)
            mlp_width = 0 if mlp is None else mlp[1].in_features
            widths += [mlp_width] + ([] if sparse is None else [sparse.width])
            self._layers.append(LayerWeights(
                data_ptr_or_null(layer.input_layernorm.weight), data_ptr_or_null(layer.post_attention_layernorm.weight),
                data_ptr_or_null(q_norm), data_ptr_or_null(k_norm),
                attention.qkv_proj.kernel_weight().struct_address(), data_ptr_or_null(attention.qkv_proj.bias),
                attention.o_proj.kernel_weight().struct_address(), data_ptr_or_null(attention.o_proj.bias),
                None if mlp is None else mlp[0].kernel_weight().struct_address(),
                None if mlp is None else mlp[1].kernel_weight().struct_address(),
                mlp_width, None if sparse is None else ctypes.pointer(sparse.struct),
                int(not config.layer_rotates(index)), data_ptr_or_null(self._sinks[index]),
            ))  # fmt: skip
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        self._scratch = DecodeScratch(
            config, q_size + 2 * kv_size, q_size, q_size, kv_size, max(widths), self._num_threads,
            library.attention_segment_rows(),
        )  # fmt: skip
        self._impls = impls_by_rows(list(model.layers), _layer_impls, self._sparse)
        self._rotary = model.rotary
        # Each layer reads its KV cache group (sliding and full layers: gpt-oss); a sliding
        # group's rows start at their window.
        layout = kv_cache_layout(config)
        self._groups = [layer.self_attn.kv_group for layer in model.layers]
        self._windows = list(layout.windows)

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether the model's shape and weights are what the native layer computes."""
        params = list(model.parameters())
        config = model.config
        return (
            computes_llama_layers(model)
            and all(p.dtype is torch.bfloat16 and p.device.type == "cpu" and p.is_contiguous() for p in params)
            and config.hidden_activation == "silu"
            and all(SparseLayer.supports(layer.mlp) for layer in model.layers if is_sparse(layer))
            # Qwen3's q/k norms are plain RMSNorms over float32 heads (csrc/layer_rows.h).
            and all(type(getattr(layer.self_attn, "q_norm", None)) in (type(None), RMSNorm) for layer in model.layers)
            and model.local_rotary is None  # every layer on the global rotary table
            and config.rotary_dim == config.head_dim  # the C paths rotate whole heads
            and config.head_dim % 2 == 0
        )

    def applies(self, num_tokens: int, kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> bool:
        """Whether a step of `num_tokens` rows over these caches runs here (its embeddings
        are bf16: every parameter is, supports())."""
        return (
            0 < num_tokens <= MAX_ROWS
            and self._impls[num_tokens] is not None
            and (metadata.num_reqs == num_tokens or _longest_query(metadata) <= MAX_ROWS_PER_REQUEST)
            and kv_caches[0].dtype in CACHE_DTYPES
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
        scratch = self._scratch.struct(max_seq_len, shape.num_heads)
        shape.block_size = kv_caches[0].shape[2]
        shape.cache_type = ELEMENT_TYPES[kv_caches[0].dtype]
        inputs, keep = [], []
        for group, window in enumerate(self._windows):  # each KV cache group's tables and slots
            group_metadata = metadata.for_group(group)
            tables = group_metadata.block_tables
            # A sliding group's row attends from its window's first position (its context ends at seq_lens).
            starts = None if window is None else (seq_lens - window).clamp(min=0).contiguous()
            keep.append(starts)
            inputs.append(StepInputs(
                m, positions.data_ptr(), group_metadata.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0),
                rows.data_ptr(), reqs.data_ptr(), seq_lens.data_ptr(), max_seq_len,
                self._rotary.cos_cache.data_ptr(), self._rotary.sin_cache.data_ptr(), data_ptr_or_null(starts),
            ))  # fmt: skip
        hidden = hidden.to(torch.float32).contiguous()
        hidden_ptr = hidden.data_ptr()
        shape_ref, scratch_ref = ctypes.byref(shape), ctypes.byref(scratch)
        inputs_refs = [ctypes.byref(group_inputs) for group_inputs in inputs]
        for weights, cache, impls, group in zip(self._layers, kv_caches, self._impls[m], self._groups, strict=True):
            shape.linear_impl = impls
            self._run_layer(
                hidden_ptr, ctypes.byref(weights), cache[0].data_ptr(), cache[1].data_ptr(),
                shape_ref, inputs_refs[group], scratch_ref,
            )  # fmt: skip
        return hidden
