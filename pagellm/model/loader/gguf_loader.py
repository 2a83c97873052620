"""Model stage: load a GGUF file (llama.cpp's format): config, weights, tokenizer."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pagellm.errors import ModelLoadError, UnsupportedModelError
from pagellm.kernels.weights import (
    QUANTIZED_TYPES,
    WeightPart,
    WeightType,
    block_bytes,
    file_row_bytes,
    pack_rows,
)
from pagellm.config.model import ModelConfig, RopeScaling
from pagellm.model.registry import SUPPORTED_GGUF_ARCHITECTURES
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
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# llama.cpp's defaults where a Gemma file leaves a key out: the sliding pattern (all but
# every n-th layer slide), Gemma 2's soft caps, Gemma 3's sliding layers' rotary base.
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA2_SOFTCAPS = (50.0, 30.0)
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# The 27B models (by layer count) scale attention by hidden / heads, not the head size.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# rope frequency divisors (Llama 3 GGUFs) and LongRoPE's factors (Phi-3 GGUFs) are not
# parameters but shape the rotary cache.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
NOT_PARAMETERS = frozenset({ROPE_FREQS_TENSOR, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT})



def gguf_fields(reader: GGUFReader) -> tuple[dict[str, Any], set[str]]:
    """Scalar metadata as plain Python values (large arrays such as vocabularies skipped),
    and the keys whose values could not be read."""
    fields: dict[str, Any] = {}
    unreadable: set[str] = set()
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and len(field.data) > 1:
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # the reader's own errors on bad bytes: named if the key is used
            unreadable.add(key)
    return fields, unreadable


class _Metadata:
    """Typed reads of a GGUF file's model metadata: a value that is unreadable, of the
    wrong type or out of range is a ModelLoadError naming its key; a missing optional
    key takes the format's default, logged."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.values, self.unreadable = gguf_fields(reader)
        self.path = path

    def raw(self, key: str) -> Any:
        if key in self.unreadable:
            raise ModelLoadError(f"GGUF metadata {key} in {self.path} cannot be read (corrupted or of an unknown type)")
        return self.values.get(key)

    def number(self, key: str, kind: type, default: float | None = None, minimum: float = 1) -> Any:
        value = self.raw(key)
        if value is None:
            if default is None:
                raise ModelLoadError(f"GGUF file {self.path} lacks metadata key {key}")
            logger.info("GGUF file %s has no %s: using the format's default %s", self.path, key, default)
            return kind(default)
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or (kind is int and value != int(value)) or value < minimum:
            expected = "an integer" if kind is int else "a number"
            raise ModelLoadError(f"GGUF metadata {key} in {self.path} is {value!r}, not {expected} >= {minimum:g}")
        return kind(value)


def gguf_model_config(reader: GGUFReader, path: Path) -> ModelConfig:
    meta = _Metadata(reader, path)
    arch = meta.raw("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def integer(key: str, default: int | None = None) -> int:
        return meta.number(f"{arch}.{key}", int, default)

    def real(key: str, default: float | None = None, minimum: float = 0.0) -> float:
        return meta.number(f"{arch}.{key}", float, default, minimum)

    names = {t.name for t in reader.tensors}
    hidden = integer("embedding_length")
    num_heads = integer("attention.head_count")
    num_kv_heads = integer("attention.head_count_kv", num_heads)  # optional: no grouped-query attention
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"GGUF metadata in {path}: {num_heads} attention heads do not split into {num_kv_heads} KV heads")
    if meta.raw(f"{arch}.vocab_size") is not None:
        vocab_size = integer("vocab_size")
    else:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ModelLoadError(f"GGUF file {path} has neither {arch}.vocab_size nor a token_embd.weight tensor")
        vocab_size = int(embd.shape[1])
    scaling = None
    scaling_type = meta.raw(f"{arch}.rope.scaling.type")
    context_length = integer("context_length")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", factor=real("rope.scaling.factor", minimum=1.0))
    elif scaling_type == "yarn":
        # llama.cpp's converter writes the factor and the original context; the ramp's ends
        # only where the checkpoint set them (its runtime defaults are YaRN's, 32 and 1).
        scaling = RopeScaling(
            "yarn",
            factor=real("rope.scaling.factor", minimum=1.0),
            original_max_position_embeddings=integer("rope.scaling.original_context_length", context_length),
            beta_fast=real("rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=real("rope.scaling.yarn_beta_slow", 1.0),
        )
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling_type!r} is not supported")
    factors = {t.name: t for t in reader.tensors if t.name in (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)}
    if len(factors) == 2:  # LongRoPE (Phi-3): per-frequency divisors inside and beyond the original context
        original = integer("rope.scaling.original_context_length", context_length)
        attn_factor = meta.raw(f"{arch}.rope.scaling.attn_factor")
        scaling = RopeScaling(
            "longrope",
            factor=context_length / original,
            original_max_position_embeddings=original,
            attention_factor=None if attn_factor is None else real("rope.scaling.attn_factor"),
            short_factor=tuple(float(v) for v in dequantize_tensor(factors[ROPE_FACTORS_SHORT]).reshape(-1)),
            long_factor=tuple(float(v) for v in dequantize_tensor(factors[ROPE_FACTORS_LONG]).reshape(-1)),
        )
    head_dim = integer("attention.key_length", hidden // num_heads)
    rotary_dims = integer("rope.dimension_count", head_dim)
    experts: dict[str, Any] = {}
    if meta.raw(f"{arch}.expert_count"):  # Mixtral (filed as llama), Qwen3-MoE, Qwen2-MoE
        norm = meta.raw(f"{arch}.expert_weights_norm")
        experts = {
            "num_experts": integer("expert_count"),
            "num_experts_per_tok": integer("expert_used_count"),
            "moe_intermediate_size": integer("expert_feed_forward_length", 0) or None,
            # llama.cpp renormalizes the chosen experts' weights (Mixtral, Qwen3-MoE) unless
            # told; Qwen2-MoE's it never does.
            "norm_topk_prob": arch != "qwen2moe" if norm is None else bool(norm),
            "shared_expert_intermediate_size": (
                integer("expert_shared_feed_forward_length")
                if meta.raw(f"{arch}.expert_shared_feed_forward_length") is not None else 0
            ),
        }
    eos = meta.raw("tokenizer.ggml.eos_token_id")
    bos = meta.raw("tokenizer.ggml.bos_token_id")
    num_layers = integer("block_count")
    gemma = _gemma_fields(meta, arch, hidden, num_heads, head_dim, num_layers) if arch in GEMMA_ARCHITECTURES else {}
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=integer("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=real("attention.layer_norm_rms_epsilon", minimum=0.0),
        # Optional in the format; llama.cpp's default.
        rope_theta=real("rope.freq_base", 10000.0, minimum=1e-6),
        rope_scaling=scaling,
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        partial_rotary_factor=rotary_dims / head_dim,
        **experts,
        **gemma,
        bos_token_id=meta.number("tokenizer.ggml.bos_token_id", int, minimum=0) if bos is not None else None,
        eos_token_ids=(meta.number("tokenizer.ggml.eos_token_id", int, minimum=0),) if eos is not None else (),
        pooling_type=_gguf_pooling(meta, arch),
    )


# llama.cpp's pooling_type values (enum llama_pooling_type) -> ModelConfig.pooling_type.
_GGUF_POOLING = {0: "last", 1: "mean", 2: "cls", 3: "last"}  # 0: none (a generative model: its last token)


def _gguf_pooling(meta: _Metadata, arch: str) -> str:
    if meta.raw(f"{arch}.pooling_type") is None:
        return "last"
    value = meta.number(f"{arch}.pooling_type", int, minimum=0)
    if value not in _GGUF_POOLING:
        raise UnsupportedModelError(f"GGUF metadata {arch}.pooling_type = {value} (rank pooling) is not supported")
    return _GGUF_POOLING[value]


def _gemma_fields(meta: _Metadata, arch: str, hidden: int, num_heads: int, head_dim: int, num_layers: int) -> dict[str, Any]:
    """Gemma 2/3's numerics from a GGUF file, with llama.cpp's defaults and rules where the
    file is silent (its converter writes the window and Gemma 2's caps; the sliding pattern,
    the attention scale and Gemma 3's local rotary base are implied by the architecture)."""

    def optional(key: str, default: float | None, kind: type = float) -> Any:
        value = meta.raw(f"{arch}.{key}")
        return default if value is None else meta.number(f"{arch}.{key}", kind, minimum=1e-9)

    window = optional("attention.sliding_window", None, int)
    pattern = meta.raw(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters: one flag per layer (true: sliding)
        if len(pattern) != num_layers:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.sliding_window_pattern lists {len(pattern)} layers, not {num_layers}")
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        every = optional("attention.sliding_window_pattern", _GEMMA_SLIDING_PATTERN[arch], int)
        sliding = tuple(i for i in range(num_layers) if (i + 1) % every)
    scale_key = meta.raw(f"{arch}.attention.scale")
    if scale_key is not None:
        attention_scale = optional("attention.scale", None)
    elif num_layers == _GEMMA_27B_LAYERS[arch]:
        attention_scale = (hidden / num_heads) ** -0.5
    else:
        attention_scale = head_dim**-0.5
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_tanh",
        "embedding_multiplier": hidden**0.5,
        "attention_scale": attention_scale,
        "sliding_window": window if window and sliding else None,
        "sliding_window_layers": sliding if window and sliding and len(sliding) < num_layers else None,
    }
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = optional("attn_logit_softcapping", _GEMMA2_SOFTCAPS[0])
        fields["final_logit_softcapping"] = optional("final_logit_softcapping", _GEMMA2_SOFTCAPS[1])
    else:
        fields["local_rope_theta"] = optional("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)
        fields["final_logit_softcapping"] = optional("final_logit_softcapping", None)
    return fields


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 in PyTorch's (row-major, outermost first) shape."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {tensor.name} uses quantization {qtype.name}, which cannot be dequantized"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(values, dtype=np.float32).reshape(shape)


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
_KEEPABLE = re.compile(r"(_proj\.weight|embed_tokens\.weight|lm_head\.weight)$")


def iter_gguf_weights(
    reader: GGUFReader,
    config: ModelConfig,
    keep_types: frozenset[WeightType] = frozenset(),
    shard: TPLayout | None = None,
) -> Iterator[tuple[str, torch.Tensor | WeightPart]]:
    """(HF name, tensor) for every model tensor of the file: float32, or a `WeightPart`
    holding the stored blocks where the tensor's type is in `keep_types`.

    A quantized tensor of a type not kept is dequantized with one log line naming it.
    With `shard`, each tensor is this tensor-parallel rank's share of it; quantized blocks
    are split as stored, except where a column split would cut a block (dequantized then).
    """
    for tensor in reader.tensors:
        if tensor.name in NOT_PARAMETERS:
            continue
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
                    logger.info(
                        "tensor %s (%s): its tensor-parallel split cuts quantization blocks: dequantized",
                        tensor.name, qtype.name,
                    )  # fmt: skip
                else:
                    yield name, part
            if not to_dequantize:
                continue
        else:
            to_dequantize = None  # every piece
            if qtype not in _FLOAT_TYPES and keep_types:
                logger.info("tensor %s (%s) has no native kernel here: dequantized", tensor.name, qtype.name)
        values = dequantize_tensor(tensor)
        for name, piece in split_fused(hf_name, values, config):
            if to_dequantize is not None and name not in to_dequantize:
                continue
            heads = _permuted_heads(name, config)
            if heads is not None:
                piece = undo_rope_permutation(piece, heads)
            if not piece.flags.writeable or not piece.flags.c_contiguous:
                piece = np.array(piece)  # unquantized tensors are read-only views of the mmap
            if config.architecture in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
                piece -= 1.0  # llama.cpp stores Gemma's norm weights as 1 + w
            weight = torch.from_numpy(piece)
            yield name, weight if shard is None else shard_float(shard, name, weight)


def _piece_name(hf_name: str, config: ModelConfig) -> str:
    """The first projection's name of a fused tensor (what decides if it may stay as stored)."""
    pieces = fused_pieces(hf_name, config)
    return hf_name if pieces is None else pieces[0][0]


def _permuted_heads(hf_name: str, config: ModelConfig) -> int | None:
    """The head count whose rows llama.cpp's converter permuted (Llama's q and k only)."""
    if config.architecture != "llama":
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
    try:
        weight_type = WeightType(int(qtype))
    except ValueError:
        return None
    return weight_type if weight_type in QUANTIZED_TYPES else None


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
    names = _GEMMA_LAYER_NAMES if architecture in GEMMA_ARCHITECTURES else _LAYER_NAMES
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in names:
        raise UnsupportedModelError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{names[kind]}.{suffix}"
