"""Model stage: a GGUF file's metadata as a ModelConfig, without torch (numpy and the gguf
package read the file).

Every key is read typed: a value that is unreadable, of the wrong type or out of range is
a ModelLoadError naming its key; a missing optional key takes llama.cpp's default, logged.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pagellm.config.model import LinearAttentionSpec, ModelConfig, RopeScaling
from pagellm.errors import ModelLoadError, UnsupportedModelError
from pagellm.model.checkpoint.architectures import SUPPORTED_GGUF_ARCHITECTURES

logger = logging.getLogger(__name__)

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# Qwen3.5 / 3.6 (dense and MoE) and Qwen3-Next: hybrids whose linear-attention layers
# llama.cpp files as `ssm_*`.
HYBRID_GGUF_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")


# llama.cpp's defaults where a Gemma file leaves a key out: the sliding pattern (all but
# every n-th layer slide), Gemma 2's soft caps, Gemma 3's sliding layers' rotary base.
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}


_GEMMA2_SOFTCAPS = (50.0, 30.0)


_GEMMA3_LOCAL_ROPE_BASE = 10000.0


# The 27B models (by layer count) scale attention by hidden / heads, not the head size.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


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
    gemma4: dict[str, Any] = {}
    if arch == "gemma4":  # per-layer head counts and MLP widths, read first (arrays)
        gemma4 = _gemma4_fields(meta, reader, arch, names, hidden)
    num_kv_heads = gemma4.pop("_kv_heads", None) or integer("attention.head_count_kv", num_heads)  # optional: no GQA
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
    if gemma4:  # key_length is the global layers' head size there; the sliding layers' is key_length_swa
        head_dim = integer("attention.key_length_swa")
        rotary_dims = integer("rope.dimension_count_swa", head_dim)
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
    family: dict[str, Any] = {}  # what a family adds to Llama's layer
    if arch in GEMMA_ARCHITECTURES:
        family = _gemma_fields(meta, arch, hidden, num_heads, head_dim, num_layers)
    if arch == "gpt-oss":
        family = _gpt_oss_fields(meta, arch, num_layers)
        expert_types = {t.tensor_type for t in reader.tensors if "_exps.weight" in t.name}
        if expert_types == {GGMLQuantizationType.MXFP4}:
            family["expert_bits_per_weight"] = 4.25
        # The original YaRN does not round its ramp's ends (HF's config says truncate: false).
        scaling = None if scaling is None else dataclasses.replace(scaling, truncate=False)
    hybrid: dict[str, Any] = {}
    if arch in HYBRID_GGUF_ARCHITECTURES:
        # Multi-token-prediction blocks follow the model's own (not run here, skipped at load).
        num_layers -= integer("nextn_predict_layers", 0) if meta.raw(f"{arch}.nextn_predict_layers") is not None else 0
        hybrid = _hybrid_fields(meta, arch, num_layers)
    feed_forward = meta.raw(f"{arch}.feed_forward_length")
    if gemma4:
        family = gemma4
        if experts:
            experts.update({"experts_beside_mlp": True, "norm_topk_prob": True})
    if feed_forward is None and experts:  # Qwen3.5-MoE's files: no dense MLP anywhere
        intermediate_size = experts["moe_intermediate_size"] or 0
    elif isinstance(feed_forward, list) and gemma4:  # the KV-shared layers' double-wide MLPs
        intermediate_size = int(min(feed_forward))
    else:
        intermediate_size = integer("feed_forward_length")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size,
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
        qk_norm=any(name.endswith(".attn_q_norm.weight") for name in names),  # a hybrid's first layer may not attend
        partial_rotary_factor=rotary_dims / head_dim,
        **experts,
        **family,
        **hybrid,
        bos_token_id=meta.number("tokenizer.ggml.bos_token_id", int, minimum=0) if bos is not None else None,
        eos_token_ids=(meta.number("tokenizer.ggml.eos_token_id", int, minimum=0),) if eos is not None else (),
        pooling_type=_gguf_pooling(meta, arch),
        # llama.cpp's smollm3: every fourth layer has no rotary, a rule of the architecture
        # (no metadata key says it).
        nope_layers=tuple(i for i in range(num_layers) if (i + 1) % 4 == 0) if arch == "smollm3" else (),
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


def _gemma4_fields(meta: _Metadata, reader: GGUFReader, arch: str, names: set[str], hidden: int) -> dict[str, Any]:
    """Gemma 4 as llama.cpp's converter records it: one sliding flag per layer, the global
    layers' head size as key_length (the sliding ones' as key_length_swa), per-layer KV
    head counts and MLP widths as arrays where they differ, the shared layers' count, the
    per-layer input width (its vocabulary from its embedding), "proportional" rotary as a
    rope_freqs tensor of divisors (1: the frequency turns; 1e30: it does not), keys as
    values where a global layer has no attn_v. Its norms are stored as they are (w)."""
    num_layers = meta.number(f"{arch}.block_count", int)
    pattern = meta.raw(f"{arch}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ModelLoadError(f"GGUF metadata {arch}.attention.sliding_window_pattern must flag each of the {num_layers} layers")
    sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    full = [i for i in range(num_layers) if i not in sliding]
    if not full:
        raise ModelLoadError(f"GGUF file {meta.path}: Gemma 4 needs a global (full-attention) layer")

    def per_layer(key: str) -> list[int] | None:
        value = meta.raw(f"{arch}.{key}")
        if isinstance(value, list):
            if len(value) != num_layers or not all(isinstance(v, int) and v > 0 for v in value):
                raise ModelLoadError(f"GGUF metadata {arch}.{key} must hold a positive integer for each of the {num_layers} layers")
            return [int(v) for v in value]
        return None

    kv_heads = per_layer("attention.head_count_kv")
    widths = per_layer("feed_forward_length")
    shared = meta.number(f"{arch}.attention.shared_kv_layers", int, 0, minimum=0)
    divisors = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    share = 1.0
    if divisors is not None:
        values = dequantize_tensor(divisors).reshape(-1)
        share = float((values < 1e29).sum()) / len(values)
    per_layer_size = meta.number(f"{arch}.embedding_length_per_layer_input", int, 0, minimum=0)
    per_layer_vocab = 0
    if per_layer_size:
        table = next((t for t in reader.tensors if t.name == "per_layer_token_embd.weight"), None)
        if table is None:
            raise ModelLoadError(f"GGUF file {meta.path} has per-layer inputs but no per_layer_token_embd.weight")
        per_layer_vocab = int(table.shape[1])
    local_theta = meta.raw(f"{arch}.rope.freq_base_swa")
    cap = meta.raw(f"{arch}.final_logit_softcapping")
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_tanh",
        "embedding_multiplier": hidden**0.5,
        "attention_scale": 1.0,
        "sliding_window": meta.number(f"{arch}.attention.sliding_window", int) if sliding else None,
        "sliding_window_layers": sliding if sliding else None,
        "local_rope_theta": 10_000.0 if local_theta is None else meta.number(f"{arch}.rope.freq_base_swa", float, minimum=1e-6),
        "final_logit_softcapping": None if cap is None else meta.number(f"{arch}.final_logit_softcapping", float, minimum=1e-9),
        "global_head_dim": meta.number(f"{arch}.attention.key_length", int),
        "num_global_key_value_heads": None if kv_heads is None else kv_heads[full[0]],
        "attention_k_eq_v": f"blk.{full[0]}.attn_v.weight" not in names,
        "global_rotated_share": share,
        "num_kv_shared_layers": shared,
        "double_wide_shared_mlp": widths is not None and max(widths) == 2 * min(widths),
        "per_layer_input_size": per_layer_size,
        "per_layer_input_vocab_size": per_layer_vocab,
        "value_norm": True,
    }
    if kv_heads is not None:
        fields["_kv_heads"] = kv_heads[sliding[0]] if sliding else kv_heads[0]
    return fields


def _gpt_oss_fields(meta: _Metadata, arch: str, num_layers: int) -> dict[str, Any]:
    """gpt-oss as llama.cpp runs it: the window on every other layer from the first, the
    sinks, biased router and experts, and the clamped SwiGLU at the architecture's constants
    (limit 7, alpha 1.702: no metadata key says them)."""
    return {
        "sliding_window": meta.number(f"{arch}.attention.sliding_window", int),
        "sliding_window_layers": tuple(range(0, num_layers, 2)),
        "attention_sinks": True, "expert_bias": True, "softmax_after_topk": True,
        "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
    }  # fmt: skip


def _hybrid_fields(meta: _Metadata, arch: str, num_layers: int) -> dict[str, Any]:
    """Qwen3.5's and Qwen3-Next's linear attention as llama.cpp's converter records it:
    every `full_attention_interval`-th layer attends (4 when left out), the others are Gated
    DeltaNet with the `ssm.*` shapes (`ssm.inner_size` is value heads x value head size).
    A qwen35 file keeps the value heads tiled (see LinearAttentionSpec; a qwen3next one
    grouped, as HF's), and the (1 + w) norms' weights with the 1 added, as Gemma's."""

    def integer(key: str, default: int | None = None) -> int:
        return meta.number(f"{arch}.{key}", int, default)

    interval = integer("full_attention_interval", 4)
    value_heads = integer("ssm.time_step_rank")
    inner_size = integer("ssm.inner_size")
    if inner_size % value_heads:
        raise ModelLoadError(f"GGUF metadata {arch}.ssm.inner_size {inner_size} does not split into {value_heads} value heads")
    spec = LinearAttentionSpec(
        layers=tuple(i for i in range(num_layers) if (i + 1) % interval),
        num_key_heads=integer("ssm.group_count"),
        num_value_heads=value_heads,
        key_head_dim=integer("ssm.state_size"),
        value_head_dim=inner_size // value_heads,
        conv_kernel_size=integer("ssm.conv_kernel"),
        value_heads_tiled=arch != "qwen3next",
    )
    return {"linear_attention": spec, "attention_output_gate": True, "norm_weight_offset": True}


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
