"""Model stage: CPU bf16: decode steps of up to 20 requests on Qwen3.5 (dense and MoE) run each
hybrid layer as one native call (kernels/csrc/hybrid_decode_layer.c) instead of the hybrid
layer ops' ten (model/native/hybrid_layers.py).

The layer ops spend a few microseconds of Python and a fork and join of the threads per call,
~4 ms per step of a 24-layer model; one call per layer takes the whole layer in one parallel
region: the (1 + w) norms, the Gated DeltaNet's projection, conv step, gates, delta rule on the
requests' state slots (csrc/gated_delta.c) and gated norm, or gated attention's projection,
q/k norms, partial rotary, cache store, paged attention and output gate; then the MLP or
the experts (csrc/decode_layer.c's MLP half: routed in C, a shared expert behind its gate).
The precision is the layer ops': float32 residual stream, linear outputs and state, bf16
only where a matmul reads.

Taken for decode-only steps (one token per request) where every linear's measured kernel for
the step's rows is a native one; a request whose token ends at a snapshot boundary has its
state copied to the snapshot after each Gated DeltaNet layer (prefix caching). Whether this or the layer ops runs a
step of a given size is measured (worker/step_paths/choice.py), as for the Llama layer.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.kv_cache_dtype import ELEMENT_TYPES
from pagellm.kernels.abi import HybridLayer, LinearMixer
from pagellm.kernels.decode_layer import (
    CACHE_DTYPES,
    MAX_ROWS,
    LayerShape,
    LayerWeights,
    StepInputs,
    data_ptr_or_null,
    native_impl,
)
from pagellm.model.native.fused_decode import DecodeScratch, SparseLayer, impls_by_rows, is_sparse, mlp_linears
from pagellm.model.native.hybrid_layers import HybridLayers, offset_scale


def _layer_impls(layer: torch.nn.Module, rows: int) -> tuple[int, int, int, int] | None:
    """The native kernels of a layer's mixer projections (in and out) and its MLP (a sparse
    layer's shared expert; 0 where it has none) at `rows` rows (None: one is oneDNN)."""
    mixer = layer.linear_attn
    if mixer is not None:
        linears = [mixer.in_proj, mixer.out_proj]
    else:
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    mlp = mlp_linears(layer)
    impls = [native_impl(linear, rows) for linear in [*linears, *(mlp or ())]]
    return None if None in impls else (*impls, 0, 0)[:4]  # type: ignore[return-value]


class _Mixer:
    """What the C layer reads of a Gated DeltaNet (float32 copies kept alive here); the state
    pointers are set per step from the step's metadata."""

    def __init__(self, mixer: torch.nn.Module) -> None:
        self.conv_weight, self.a_log, self.dt_bias = mixer.float32_parameters()
        self.norm_weight = mixer.norm.weight.detach().float().contiguous()
        shape = mixer.shape
        self.struct = LinearMixer(
            mixer.in_proj.kernel_weight().struct_address(), mixer.out_proj.kernel_weight().struct_address(),
            self.conv_weight.data_ptr(), self.a_log.data_ptr(), self.dt_bias.data_ptr(), self.norm_weight.data_ptr(),
            None, None, shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim,
            self.conv_weight.shape[1], int(shape.tiled),
        )  # fmt: skip


class HybridFusedDecode:
    """Runs a decode step of <= MAX_ROWS requests through the native hybrid layer, for one model."""

    def __init__(self, library: ctypes.CDLL, model: torch.nn.Module) -> None:
        config = model.config
        self._run_layer = library.hybrid_decode_layer_bf16
        self._num_threads = torch.get_num_threads()
        attention = next(layer.self_attn for layer in model.layers if layer.self_attn is not None)
        self._kv_group = attention.kv_group
        self._shape = LayerShape(
            config.hidden_size, attention.num_heads, attention.num_kv_heads, attention.head_dim, 0,
            config.rms_norm_eps, attention.scale, self._num_threads, ELEMENT_TYPES[torch.bfloat16],
        )  # fmt: skip
        self._sparse = [SparseLayer(layer.mlp) if is_sparse(layer) else None for layer in model.layers]
        self._mixers = [None if layer.linear_attn is None else _Mixer(layer.linear_attn) for layer in model.layers]
        self._scales: list[torch.Tensor] = []  # the float32 norm scales the structures point at
        self._layers: list[HybridLayer] = []
        widths = [1]
        for layer, sparse, mixer in zip(model.layers, self._sparse, self._mixers, strict=True):
            mlp = mlp_linears(layer)
            mlp_width = 0 if mlp is None else mlp[1].in_features
            widths += [mlp_width] + ([] if sparse is None else [sparse.width])
            gated = layer.self_attn
            base = LayerWeights(
                None, None, None, None,
                None if gated is None else gated.qkv_proj.kernel_weight().struct_address(), None,
                None if gated is None else gated.o_proj.kernel_weight().struct_address(), None,
                None if mlp is None else mlp[0].kernel_weight().struct_address(),
                None if mlp is None else mlp[1].kernel_weight().struct_address(),
                mlp_width, None if sparse is None else ctypes.pointer(sparse.struct),
            )  # fmt: skip
            scales = [offset_scale(layer.input_layernorm), offset_scale(layer.post_attention_layernorm)]
            if gated is not None:
                scales += [offset_scale(gated.q_norm), offset_scale(gated.k_norm)]
            self._scales += scales
            q_scale, k_scale = (None, None) if gated is None else (scales[2].data_ptr(), scales[3].data_ptr())
            self._layers.append(HybridLayer(
                base, scales[0].data_ptr(), scales[1].data_ptr(), q_scale, k_scale,
                None if mixer is None else ctypes.pointer(mixer.struct), 2 * model.rotary.cos_cache.shape[1],
            ))  # fmt: skip
        q_size = attention.num_heads * attention.head_dim
        kv_size = attention.num_kv_heads * attention.head_dim
        spec = config.linear_attention
        value_size = spec.num_value_heads * spec.value_head_dim
        conv_dim = model.layers[spec.layers[0]].linear_attn.conv_dim
        projection = max(2 * q_size + 2 * kv_size, conv_dim + value_size + 2 * spec.num_value_heads)
        self._scratch = DecodeScratch(
            config, projection, q_size, max(q_size, value_size), kv_size, max(widths), self._num_threads,
            library.attention_segment_rows(), mixer=(conv_dim, value_size),
        )  # fmt: skip
        self._impls = impls_by_rows(list(model.layers), _layer_impls, self._sparse)
        self._rotary = model.rotary
        self._attention_layers = [i for i, layer in enumerate(model.layers) if layer.self_attn is not None]

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """The hybrid layer ops' models (HybridLayers.supports), on one rank (the layer has no
        point to all-reduce at), whose sparse layers the C layer routes."""
        return (
            model.tp is None
            and HybridLayers.supports(model)
            and model.config.sliding_window is None
            and all(SparseLayer.supports(layer.mlp) for layer in model.layers if is_sparse(layer))
        )

    def applies(self, num_tokens: int, kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> bool:
        """Whether this step runs here: decodes only (one token per request), native kernels
        for its rows, caches and states the C layer reads."""
        linear = metadata.linear
        if not (0 < num_tokens <= MAX_ROWS and metadata.num_reqs == num_tokens and self._impls[num_tokens] is not None):
            return False
        if linear is None:
            return False
        states = linear.layer_states[0]
        group = metadata.for_group(self._kv_group)
        return (
            states.conv.dtype is torch.float32
            and states.recurrent.dtype is torch.float32
            and all(s.conv.is_contiguous() and s.recurrent.is_contiguous() for s in linear.layer_states)
            and all(kv_caches[i].dtype in CACHE_DTYPES and kv_caches[i].is_contiguous() for i in self._attention_layers)
            and group.block_tables.dtype is torch.int64
            and group.block_tables.is_contiguous()
        )

    def run(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size] bf16 embeddings
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float32, before the final norm
        m = hidden.shape[0]
        linear = metadata.linear
        assert linear is not None
        group = metadata.for_group(self._kv_group)
        rows = torch.arange(m, dtype=torch.int64)
        positions = positions.contiguous()
        seq_lens = torch.tensor(group.seq_lens, dtype=torch.int64)
        state_slots = torch.tensor(linear.state_slots, dtype=torch.int64)
        max_seq_len = max(group.seq_lens)
        shape = self._shape
        scratch = self._scratch.struct(max_seq_len, shape.num_heads)
        attention_cache = kv_caches[self._attention_layers[0]]
        shape.block_size = attention_cache.shape[2]
        shape.cache_type = ELEMENT_TYPES[attention_cache.dtype]
        tables = group.block_tables
        inputs = StepInputs(
            m, positions.data_ptr(), group.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0),
            rows.data_ptr(), rows.data_ptr(), seq_lens.data_ptr(), max_seq_len,
            self._rotary.cos_cache.data_ptr(), self._rotary.sin_cache.data_ptr(),
        )  # fmt: skip
        states = iter(linear.layer_states)
        for mixer in self._mixers:  # the worker's state tensors, as this step hands them
            if mixer is not None:
                state = next(states)
                mixer.struct.conv_states, mixer.struct.states = state.conv.data_ptr(), state.recurrent.data_ptr()
        # (slot, snapshot) of each request whose token ends at a snapshot boundary.
        saves = [(slot, snapshot) for slot, request in zip(linear.state_slots, linear.saves or (), strict=False)
                 for _, snapshot in request]  # fmt: skip
        mixer_index = 0
        hidden = hidden.to(torch.float32).contiguous()
        hidden_ptr, slots_ptr = hidden.data_ptr(), state_slots.data_ptr()
        shape_ref, inputs_ref, scratch_ref = ctypes.byref(shape), ctypes.byref(inputs), ctypes.byref(scratch)
        for weights, cache, impls, mixer in zip(self._layers, kv_caches, self._impls[m], self._mixers, strict=True):
            shape.linear_impl = impls
            keys, values = (None, None) if mixer is not None else (cache[0].data_ptr(), cache[1].data_ptr())
            self._run_layer(
                hidden_ptr, ctypes.byref(weights), keys, values, shape_ref, inputs_ref, scratch_ref, slots_ptr
            )
            if mixer is not None:
                if saves:  # the state after this token, as GatedDeltaNet._decode takes it
                    state, snapshots = linear.layer_states[mixer_index], linear.snapshot_states[mixer_index]
                    for slot, snapshot in saves:
                        snapshots.conv[snapshot] = state.conv[slot]
                        snapshots.recurrent[snapshot] = state.recurrent[slot]
                mixer_index += 1
        return hidden
