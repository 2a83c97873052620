"""Model stage: read a GGUF file's weights (llama.cpp's format), kept as stored where the kernels run them
(its metadata is model/checkpoint/gguf_metadata.py's)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from pagellm.errors import ModelLoadError, UnsupportedModelError
from pagellm.kernels.weights import (
    QUANTIZED_TYPES,
    WeightPart,
    WeightType,
    block_bytes,
    file_row_bytes,
    pack_rows,
)
from pagellm.config.model import ModelConfig
from pagellm.model.checkpoint.gguf_metadata import (
    GEMMA_ARCHITECTURES,
    NOT_PARAMETERS,
    HYBRID_GGUF_ARCHITECTURES,
    ROPE_FREQS_TENSOR,
    dequantize_tensor,
)
from pagellm.model.loader.checkpoint_layouts import fused_pieces, split_fused
from pagellm.model.tensor_parallel import TPLayout, shard_blocks, shard_float

logger = logging.getLogger(__name__)

# GGUF tensor names -> HF names (per layer names after "blk.N.").
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the experts' router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [experts, rows, cols], cut per expert at load
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's four norms per layer: llama.cpp's `ffn_norm` is the norm before the MLP there,
# with post-norms of their own after attention and after the MLP.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3.5's and Qwen3-Next's: a Gated DeltaNet's tensors are llama.cpp's `ssm_*` (its conv,
# decay and output) and `attn_qkv`/`attn_gate` (the projections into the conv and the output
# gate; Qwen3-Next's b and a stay fused per key head in `ssm_ba`, and older files hold its
# fused q, k, v and z as `ssm_in`); `post_attention_norm` is the norm before the MLP.
_HYBRID_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_in": "linear_attn.in_proj_qkvz",
}
# Parameters llama.cpp names apart from the rule: the decay's bias, and its rate, which the
# file holds as A = -exp(A_log) and without a suffix.
_HYBRID_PARAMETERS = {"ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log"}
# gpt-oss's: the norm before the MLP is `post_attention_norm`; the sinks, a parameter without
# a suffix in HF's checkpoint, are `attn_sinks.weight`.
_GPT_OSS_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"}
_GPT_OSS_PARAMETERS = {"attn_sinks.weight": "self_attn.sinks"}
# Gemma 4's: Gemma's four norms, the experts' block's own three, the router (its scale, and
# the per-expert scale filed under the down projections), the stacked experts (gate and up
# in one), the per-layer inputs' gate, projection and norm, the layer's scalar.
_GEMMA4_LAYER_NAMES = {
    **_GEMMA_LAYER_NAMES,
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GEMMA4_PARAMETERS = {
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
}
_GEMMA4_GLOBAL_NAMES = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_LAYER_INDEX = re.compile(r"^blk\.(\d+)\.")


def undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder q/k rows from llama.cpp's interleaved rotary layout to the HF one.

    llama.cpp's converter reorders each head's rows so rotary pairs are adjacent
    (0, half, 1, half+1, ...); our rotary embedding rotates the two halves of a head.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


# Tensors that may stay in their stored quantization: the linear layers and the embedding
# (the LM head too, or the embedding when the head is tied to it).
_KEEPABLE = re.compile(
    r"(_proj\.weight|in_proj_(qkvz|qkv|z|ba|b|a)\.weight|embed_tokens\.weight|lm_head\.weight"
    r"|embed_tokens_per_layer\.weight|_projection\.weight|per_layer_input_gate\.weight)$"  # Gemma 4's per-layer inputs
)


def iter_gguf_weights(
    reader: GGUFReader,
    config: ModelConfig,
    keep_types: frozenset[WeightType] = frozenset(),
    shard: TPLayout | None = None,
) -> Iterator[tuple[str, torch.Tensor | WeightPart]]:
    """(HF name, tensor) for every model tensor of the file: float32, or a `WeightPart`
    holding the stored blocks where the tensor's type is in `keep_types`.

    A quantized tensor of a type not kept is dequantized with one log line naming it, its
    bytes as stored and dequantized, and why; a last line totals them.
    With `shard`, each tensor is this tensor-parallel rank's share of it; quantized blocks
    are split as stored, except where a column split would cut a block (dequantized then).
    """
    dequantized = DequantizedTally()
    for tensor in reader.tensors:
        if tensor.name in NOT_PARAMETERS:
            continue
        layer = _LAYER_INDEX.match(tensor.name)
        if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
            continue  # a multi-token-prediction block after the model's own (Qwen3.5's files)
        hf_name = hf_tensor_name(tensor.name, config.architecture)
        if config.architecture == "phi3" and ".mlp.up_proj." in hf_name:
            hf_name = hf_name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")  # Phi-3's ffn_up holds gate and up
        qtype = GGMLQuantizationType(tensor.tensor_type)
        stored = _stored_type(qtype)
        if stored is not None and stored in keep_types and _KEEPABLE.search(_piece_name(hf_name, config)):
            to_dequantize: list[str] | None = []  # the pieces whose stored blocks a TP split would cut
            stored_rows = _stored_rows(tensor)
            if len(tensor.shape) == 3:  # stacked experts: [experts, rows per expert, row bytes]
                stored_rows = stored_rows.reshape(int(tensor.shape[2]), -1, stored_rows.shape[1])
            for name, rows in split_fused(hf_name, stored_rows, config):
                part = _stored_part(name, rows, stored, config, shard)
                if part is None:
                    to_dequantize.append(name)
                    dequantized.add(tensor, "its tensor-parallel split cuts quantization blocks")
                else:
                    yield name, part
            if not to_dequantize:
                continue
        else:
            to_dequantize = None  # every piece
            if qtype not in _FLOAT_TYPES and keep_types:
                reason = "it has no native kernel here" if stored is None or stored not in keep_types else "not a linear layer"
                dequantized.add(tensor, reason)
        values = dequantize_tensor(tensor)
        for name, piece in split_fused(hf_name, values, config):
            if to_dequantize is not None and name not in to_dequantize:
                continue
            heads = _permuted_heads(name, config)
            if heads is not None:
                piece = undo_rope_permutation(piece, heads)
            if not piece.flags.writeable or not piece.flags.c_contiguous:
                piece = np.array(piece)  # unquantized tensors are read-only views of the mmap
            piece = _undo_converter_changes(name, piece, config)
            weight = torch.from_numpy(piece)
            yield name, weight if shard is None else shard_float(shard, name, weight)
    dequantized.report()


class DequantizedTally:
    """The quantized tensors a load dequantizes: one log line each (name, type, bytes as
    stored and as bf16, why), and their total at the end."""

    def __init__(self) -> None:
        self.count = self.stored_bytes = self.bf16_bytes = 0

    def add(self, tensor: Any, reason: str) -> None:
        stored, bf16 = int(tensor.n_bytes), 2 * int(np.prod([int(d) for d in tensor.shape]))
        self.count += 1
        self.stored_bytes += stored
        self.bf16_bytes += bf16
        logger.info(
            "tensor %s (%s, %d bytes as stored): dequantized to %d bytes of bf16: %s",
            tensor.name, GGMLQuantizationType(tensor.tensor_type).name, stored, bf16, reason,
        )  # fmt: skip

    def report(self) -> None:
        if self.count:
            logger.info(
                "%d quantized tensors dequantized: %.1f MiB as stored held as %.1f MiB of bf16",
                self.count, self.stored_bytes / 2**20, self.bf16_bytes / 2**20,
            )  # fmt: skip


def _undo_converter_changes(hf_name: str, values: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A float tensor as the HF checkpoint held it, where llama.cpp's converter changed it:
    Gemma's and Qwen3.5's (1 + w) norms stored with the 1 added (not the gated norm of a
    Gated DeltaNet, a plain w), Qwen3.5's decay rate stored as -exp(A_log), its conv
    weights without their middle axis."""
    offset_norms = config.architecture in GEMMA_ARCHITECTURES or config.architecture in HYBRID_GGUF_ARCHITECTURES
    if offset_norms and hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        values -= 1.0
    elif hf_name.endswith(".linear_attn.A_log"):
        if not (values < 0).all():
            raise ModelLoadError(f"{hf_name}: llama.cpp's ssm_a holds -exp(A_log), so every value must be negative")
        values = np.log(-values)
    elif hf_name.endswith(".linear_attn.conv1d.weight") and values.ndim == 2:
        values = values[:, None, :]  # [channels, 1, kernel size] as a depthwise Conv1d's
    return values


def _piece_name(hf_name: str, config: ModelConfig) -> str:
    """The first projection's name of a fused tensor (what decides if it may stay as stored)."""
    pieces = fused_pieces(hf_name, config)
    return hf_name if pieces is None else pieces[0][0]


def _permuted_heads(hf_name: str, config: ModelConfig) -> int | None:
    """The head count whose rows llama.cpp's converter permuted (Llama's q and k, and those
    of the families it converts as Llama: SmolLM3)."""
    if config.architecture not in ("llama", "smollm3"):
        return None
    if ".q_proj." in hf_name:
        return config.num_attention_heads
    if ".k_proj." in hf_name:
        return config.num_key_value_heads
    return None


def _stored_part(
    hf_name: str, rows: np.ndarray, stored: WeightType, config: ModelConfig, shard: TPLayout | None
) -> WeightPart | None:
    """One projection's stored blocks as a WeightPart (this rank's share with `shard`), or
    None where a tensor-parallel split would cut a block."""
    heads = _permuted_heads(hf_name, config)
    data: np.ndarray | None = rows if heads is None else undo_rope_permutation(rows, heads)
    if shard is not None:
        data = shard_blocks(shard, hf_name, data, stored.block_elements, block_bytes(stored))
    if data is None:
        return None
    k = data.shape[1] // block_bytes(stored) * stored.block_elements
    return WeightPart(stored, torch.from_numpy(np.ascontiguousarray(pack_rows(stored, data, k))))


_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def keepable(hf_name: str) -> bool:
    """Whether a tensor (by HF name) is a linear layer's or the embedding's weight."""
    return _KEEPABLE.search(hf_name) is not None


def _stored_type(qtype: GGMLQuantizationType) -> WeightType | None:
    """The kernels' type for a tensor's stored one, where they multiply by it as stored.
    F16 is not taken from files yet: read as bf16 it is no smaller, and its exact kernels
    would change the tokens of every F16 file against the bf16 reading users have."""
    try:
        weight_type = WeightType(int(qtype))
    except ValueError:
        return None
    return weight_type if weight_type in QUANTIZED_TYPES and weight_type is not WeightType.F16 else None


def _stored_rows(tensor: Any) -> np.ndarray:  # uint8 [rows, row_bytes], a copy of the file's bytes
    """The blocks of a quantized tensor, one row per output; a tensor whose byte count does
    not match its shape and type (truncated, corrupted) is an error naming it."""
    rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
    k = int(tensor.shape[0])
    weight_type = WeightType(int(tensor.tensor_type))
    expected = rows * file_row_bytes(weight_type, k) if k % weight_type.block_elements == 0 else -1
    data = np.asarray(tensor.data)
    if data.dtype != np.uint8 or data.size != expected:
        raise ModelLoadError(
            f"tensor {tensor.name}: {weight_type.name} [{rows} x {k}] should take {expected} bytes, "
            f"the file holds {data.size} (truncated or corrupted)"
        )
    return np.array(data.reshape(rows, -1))


def quantized_tensor_types(reader: GGUFReader) -> dict[str, str]:
    """GGUF tensor name -> type name for every tensor that is not a float."""
    return {
        t.name: GGMLQuantizationType(t.tensor_type).name
        for t in reader.tensors
        if GGMLQuantizationType(t.tensor_type) not in _FLOAT_TYPES
    }


def rope_freq_divisors(reader: GGUFReader) -> torch.Tensor | None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            return torch.from_numpy(np.array(dequantize_tensor(tensor)))
    return None


def hf_tensor_name(gguf_name: str, architecture: str) -> str:
    """The HF checkpoint name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`); UnsupportedModelError for an unknown one."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if architecture == "gemma4" and gguf_name in _GEMMA4_GLOBAL_NAMES:
        return _GEMMA4_GLOBAL_NAMES[gguf_name]
    parameters: dict[str, str] = {}  # a family's parameters named apart from the rule
    if architecture == "gemma4":
        names, parameters = _GEMMA4_LAYER_NAMES, _GEMMA4_PARAMETERS
    elif architecture in HYBRID_GGUF_ARCHITECTURES:
        names, parameters = _HYBRID_LAYER_NAMES, _HYBRID_PARAMETERS
    elif architecture in GEMMA_ARCHITECTURES:
        names = _GEMMA_LAYER_NAMES
    elif architecture == "gpt-oss":
        names, parameters = _GPT_OSS_LAYER_NAMES, _GPT_OSS_PARAMETERS
    else:
        names = _LAYER_NAMES
    layer_prefix = _LAYER_INDEX.match(gguf_name)
    if layer_prefix is not None and gguf_name[layer_prefix.end() :] in parameters:
        return f"model.layers.{layer_prefix.group(1)}.{parameters[gguf_name[layer_prefix.end() :]]}"
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in names:
        raise UnsupportedModelError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{names[kind]}.{suffix}"
