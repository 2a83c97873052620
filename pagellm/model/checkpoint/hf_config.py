"""Model stage: an HF checkpoint folder's config.json (and the files beside it) as a ModelConfig, without torch."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from pagellm.errors import ModelLoadError, UnsupportedModelError
from pagellm.config.model import LinearAttentionSpec, ModelConfig, RopeScaling
from pagellm.model.checkpoint.architectures import (
    ARCHITECTURE_BY_MODEL_TYPE,
    BASE_MODEL_ARCHITECTURES,
    CLASSIFIER_ARCHITECTURES,
    SUPPORTED_HF_ARCHITECTURES,
    TEXT_MODEL_OF_MULTIMODAL,
)

logger = logging.getLogger(__name__)


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e})") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def hf_model_config(folder: Path) -> ModelConfig:
    """ModelConfig from config.json (and generation_config.json for EOS ids)."""
    cfg = read_json(folder / "config.json")
    architectures = cfg.get("architectures") or []
    # A config saved without a model (XConfig.save_pretrained) names no architecture;
    # its model_type still says which one.
    arch = architectures[0] if architectures else ARCHITECTURE_BY_MODEL_TYPE.get(cfg.get("model_type", ""))
    # A base model (e5-mistral's MistralModel, a Qwen3Model): the family's layers, no LM head.
    arch = BASE_MODEL_ARCHITECTURES.get(arch, arch)
    # A sequence classifier (a cross-encoder reranker): the family's layers and a `score` head.
    num_labels = 0
    if arch in CLASSIFIER_ARCHITECTURES:
        arch = CLASSIFIER_ARCHITECTURES[arch]
        num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
    if arch == "Gemma3ForConditionalGeneration" or (arch is None and cfg.get("model_type") == "gemma3"):
        cfg, arch = gemma3_text_config(cfg), "Gemma3ForCausalLM"
    multimodal = arch if arch in TEXT_MODEL_OF_MULTIMODAL else (cfg.get("model_type") if arch is None else None)
    if multimodal in TEXT_MODEL_OF_MULTIMODAL:
        cfg, arch = text_model_config(cfg, str(multimodal)), TEXT_MODEL_OF_MULTIMODAL[str(multimodal)]
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} in {folder / 'config.json'} is not supported; "
            f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("Llama checkpoints with mlp_bias=true are not supported")
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        rope, local_rope_theta = _rope_by_layer_kind(arch, cfg)
        rope_theta = float(rope.get("rope_theta") or 10000.0)
        # Qwen2 (and Qwen2-MoE, `qkv_bias` in transformers 5.x) bias q/k/v only.
        is_qwen2 = arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))
        attention_bias = bool(cfg.get("attention_bias", arch == "GptOssForCausalLM"))  # transformers' defaults
        sliding_window, sliding_layers = _sliding_window(arch, cfg)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(rope, int(cfg.get("max_position_embeddings", 2048))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),
            attention_bias=is_qwen2 or attention_bias,
            attention_out_bias=(not is_qwen2) and attention_bias,
            sliding_window=sliding_window,
            sliding_window_layers=sliding_layers,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM", *HYBRID_ARCHITECTURES),
            partial_rotary_factor=float(
                cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                or (0.25 if arch in HYBRID_ARCHITECTURES else 1.0)
            ),  # fmt: skip
            local_rope_theta=local_rope_theta,
            hidden_activation=_activation(cfg),
            **_gemma(arch, cfg, hidden),
            **_experts(arch, cfg),
            **_hybrid(arch, cfg),
            nope_layers=_nope_layers(arch, cfg),
            **_gpt_oss(arch, cfg),
            **_gemma4(arch, cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg, folder),
            pooling_type=_sentence_transformers_pooling(folder),
            has_lm_head=not num_labels
            and (bool(cfg.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)) or _stores_lm_head(folder)),
            num_labels=num_labels,
            is_matryoshka=bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions")),
            matryoshka_dimensions=tuple(int(d) for d in cfg["matryoshka_dimensions"]) if cfg.get("matryoshka_dimensions") else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise ModelLoadError(f"{folder / 'config.json'} is incomplete or invalid: {e!r}") from None


# sentence-transformers' pooling modes (1_Pooling/config.json) -> ModelConfig.pooling_type.
_SENTENCE_TRANSFORMERS_POOLING = {
    "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
}  # fmt: skip


def _sentence_transformers_pooling(folder: Path) -> str:
    """The pooling a sentence-transformers checkpoint declares (modules.json names its
    Pooling module's folder, whose config.json sets one pooling_mode_* flag); "last", the
    decoder models' pooling, where the folder has none."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return "last"
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {modules_file}: {e}") from None
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            settings = read_json(folder / str(module.get("path", "1_Pooling")) / "config.json")
            chosen = [kind for flag, kind in _SENTENCE_TRANSFORMERS_POOLING.items() if settings.get(flag)]
            others = [flag for flag, value in settings.items() if flag.startswith("pooling_mode_") and value and flag not in _SENTENCE_TRANSFORMERS_POOLING]
            if len(chosen) != 1 or others:
                raise UnsupportedModelError(
                    f"{folder}: sentence-transformers pooling {sorted(flag for flag, v in settings.items() if flag.startswith('pooling_mode_') and v)} "
                    "is not supported (one of last-token, mean or CLS pooling is)"
                )
            return chosen[0]
    return "last"


def _is_lm_head(name: str) -> bool:
    # A multimodal checkpoint names its text model's head under a prefix (language_model.lm_head.weight).
    return name == "lm_head.weight" or name.endswith(".lm_head.weight")


def _stores_lm_head(folder: Path) -> bool:
    """Whether the checkpoint holds an LM head. An embedding model's often does not, even
    when its config names the causal class (Qwen3-Embedding's lists Qwen3ForCausalLM): then
    it computes embeddings only. Only the names are read (the index, or each shard's header);
    a folder without weights (load_format dummy) has one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        return isinstance(weight_map, dict) and any(_is_lm_head(name) for name in weight_map)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:  # a config alone (load_format dummy draws the weights): the family's usual head
        return True
    for path in shards:
        try:
            with safe_open(str(path), framework="numpy", device="cpu") as f:
                if any(_is_lm_head(name) for name in f.keys()):
                    return True
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights from {path}: {e}") from None
    return False


GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM")
# Gemma's sliding layers when a config has no layer_types: all but every n-th (n = the
# pattern: fixed 2 in Gemma 2, `sliding_window_pattern` in Gemma 3, 6 by default).
_GEMMA_DEFAULT_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "Gemma4ForCausalLM": 6}
# HF activation names -> ModelConfig.hidden_activation.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


# transformers' Gemma3TextConfig defaults: the multimodal Gemma 3 checkpoints (4B, 12B,
# 27B) write only what differs from them into their text_config.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1,
}  # fmt: skip


def gemma3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model of a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration):
    its text_config over transformers' defaults; the vision tower is not loaded. The
    top-level eos ids (the chat models end turns with <end_of_turn>) and the top-level
    tie_word_embeddings (it decides for the whole model) win."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("a Gemma3ForConditionalGeneration config.json must hold a text_config object")
    if text.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention (an embedding model) is not supported")
    merged = {**_GEMMA3_TEXT_DEFAULTS, **text}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):  # the whole model's say
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


def text_model_config(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The language model of a multimodal checkpoint (Qwen3.5's ConditionalGeneration): its
    text_config, with the top-level settings that decide for the whole model."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"a {name} config.json must hold a text_config object")
    merged = dict(text)
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


# Hybrids: linear-attention layers beside gated attention (Qwen3.5).
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")


def _hybrid(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's linear-attention layers (`layer_types`, else every `full_attention_interval`-th
    layer attends, 4 by default), their shapes (transformers' defaults where a key is left
    out), the gated attention and the (1 + w) norms."""
    if arch not in HYBRID_ARCHITECTURES:
        return {}
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "linear_attention"}:
        raise UnsupportedModelError(
            f"layer_types must name full_attention or linear_attention for each of the {num_layers} layers, "
            f"got {layer_types!r}"
        )
    spec = LinearAttentionSpec(
        layers=tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention"),
        num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel_size=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    return {"linear_attention": spec, "attention_output_gate": True, "norm_weight_offset": True}


def _gpt_oss(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's attention sinks, biased router and experts, and the experts' clamped SwiGLU
    (transformers' defaults: limit 7, alpha 1.702)."""
    if arch != "GptOssForCausalLM":
        return {}
    quantization = cfg.get("quantization_config") or {}
    return {
        "attention_sinks": True, "expert_bias": True, "softmax_after_topk": True,
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)), "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        # OpenAI's folders: the experts in MXFP4 (32 four-bit values and an exponent byte).
        "expert_bits_per_weight": 4.25 if quantization.get("quant_method") == "mxfp4" else None,
    }  # fmt: skip


def _gemma4(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's layers (transformers' Gemma4TextConfig defaults where a key is left out):
    the global layers' head shape (`per_layer_config`, as transformers saves it, else
    `global_head_dim`, and `num_global_key_value_heads` where keys serve as values), the
    KV-shared last layers, per-layer inputs, the experts beside the MLP, the "proportional"
    rotary of the global layers."""
    if arch != "Gemma4ForCausalLM":
        return {}
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("Gemma 4 with bidirectional attention (an embedding model) is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    _, global_layers = _sliding_window(arch, cfg)
    overrides = cfg.get("per_layer_config")
    if isinstance(overrides, dict) and not overrides:  # as transformers saves global heads shaped like the rest
        global_head_dim = global_kv_heads = None
    elif isinstance(overrides, dict):
        shapes = {json.dumps(value, sort_keys=True) for value in overrides.values()}
        full = {int(layer) for layer in overrides}
        sliding = set(global_layers or ())
        if len(shapes) != 1 or full & sliding or not set(overrides[next(iter(overrides))]) <= {"head_dim", "num_key_value_heads"}:
            raise UnsupportedModelError(f"per_layer_config {overrides!r}: only the global layers' head shape may differ")
        shape = next(iter(overrides.values()))
        global_head_dim, global_kv_heads = shape.get("head_dim"), shape.get("num_key_value_heads")
    else:
        global_head_dim = cfg.get("global_head_dim", 512)
        global_kv_heads = cfg.get("num_global_key_value_heads") if k_eq_v else None
    rope = cfg.get("rope_parameters") or {}
    full_rope = rope.get("full_attention") if isinstance(rope, dict) else None
    share = 0.25 if full_rope is None else float(full_rope.get("partial_rotary_factor", 1.0)) if full_rope.get("rope_type") == "proportional" else 1.0
    per_layer_size = int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    experts: dict[str, Any] = {}
    if cfg.get("enable_moe_block"):
        experts = {
            "num_experts": int(cfg["num_experts"]), "num_experts_per_tok": int(cfg["top_k_experts"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]), "norm_topk_prob": True,
            "experts_beside_mlp": True,
        }  # fmt: skip
    return {
        "global_head_dim": None if global_head_dim is None else int(global_head_dim),
        "num_global_key_value_heads": None if global_kv_heads is None else int(global_kv_heads),
        "attention_k_eq_v": k_eq_v,
        "global_rotated_share": share,
        "num_kv_shared_layers": int(cfg.get("num_kv_shared_layers") or 0),
        "double_wide_shared_mlp": bool(cfg.get("use_double_wide_mlp", False)),
        "per_layer_input_size": per_layer_size,
        "per_layer_input_vocab_size": int(cfg.get("vocab_size_per_layer_input", 262_144)) if per_layer_size else 0,
        "value_norm": True,
        **experts,
    }  # fmt: skip


def _nope_layers(arch: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: `no_rope_layers` holds 1 for a layer that rotates,
    0 for one that does not; without it every `no_rope_layer_interval`-th layer (4 by
    default) is NoPE, as transformers fills it in."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    num_layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((layer + 1) % interval != 0) for layer in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers or not set(flags) <= {0, 1}:
        raise ModelLoadError(f"no_rope_layers must hold 0 or 1 for each of the {num_layers} layers, got {flags!r}")
    return tuple(layer for layer, rotates in enumerate(flags) if not rotates)


def _activation(cfg: dict[str, Any]) -> str:
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    return _ACTIVATIONS.get(name, name)  # an unknown one is refused by ModelConfig, named


def _gemma(arch: str, cfg: dict[str, Any], hidden: int) -> dict[str, Any]:
    """Gemma's numerics (transformers' defaults where a config leaves a key out: Gemma 2
    soft-caps scores at 50 and logits at 30, Gemma 3 neither)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    default_caps = (50.0, 30.0) if arch == "Gemma2ForCausalLM" else (None, None)

    def cap(key: str, default: float | None) -> float | None:
        value = cfg.get(key, default)
        return None if value is None else float(value)

    return {
        "embedding_multiplier": hidden**0.5,
        # Gemma 4 normalizes q and k per head and scores them unscaled.
        "attention_scale": 1.0 if arch == "Gemma4ForCausalLM" else float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        "attn_logit_softcapping": cap("attn_logit_softcapping", default_caps[0]),
        "final_logit_softcapping": cap("final_logit_softcapping", default_caps[1]),
    }


def _rope_by_layer_kind(arch: str, cfg: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The global layers' rotary settings (rope_settings' flat dict) and, for Gemma 3, the
    sliding layers' own base. transformers 5.x nests Gemma 3's rope_parameters by layer
    type ({"full_attention": {...}, "sliding_attention": {...}}); downloaded checkpoints
    carry rope_theta/rope_scaling for the global layers and `rope_local_base_freq`."""
    nested = cfg.get("rope_parameters")
    if isinstance(nested, dict) and isinstance(nested.get("full_attention"), dict):
        flat = {key: value for key, value in cfg.items() if key not in ("rope_parameters", "rope_scaling", "rope_theta")}
        rope = rope_settings({**flat, "rope_parameters": nested["full_attention"]})
        local = nested.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise UnsupportedModelError(f"rope scaling {local['rope_type']!r} on sliding layers is not supported")
        local_theta = local.get("rope_theta")
    else:
        rope = rope_settings(cfg)
        local_theta = cfg.get("rope_local_base_freq")
    if arch == "GptOssForCausalLM" and rope.get("rope_type") is None:  # transformers' defaults
        rope.update({"rope_theta": rope.get("rope_theta") or 150000.0, "rope_type": "yarn", "factor": 32.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})  # fmt: skip
    if arch == "Gemma3ForCausalLM":
        rope.setdefault("rope_theta", 1_000_000.0)
        return rope, float(local_theta or 10_000.0)
    if arch == "Gemma4ForCausalLM":
        # The global layers' "proportional" rotary is the plain one with the tail of the
        # frequencies at 0 (ModelConfig.global_rotated_share, read by _gemma4); its factor
        # divides every frequency, as linear scaling does.
        rope.setdefault("rope_theta", 1_000_000.0)
        if rope.get("rope_type") in (None, "proportional"):
            factor = float(rope.get("factor", 1.0))
            rope = {"rope_theta": rope["rope_theta"], "rope_type": "default" if factor == 1.0 else "linear", "factor": factor}
        return rope, float(local_theta or 10_000.0)
    return rope, None if local_theta is None else float(local_theta)


def _sliding_window(arch: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """The window and the layers that use it (None: every layer), from either dialect:
    transformers 5.x writes `layer_types` ("sliding_attention" / "full_attention"); older
    Qwen2-style configs say `use_sliding_window` with `max_window_layers` (the layers from
    there on slide), Gemma's a pattern (all but every n-th layer), Mistral's a bare
    `sliding_window` (every layer slides)."""
    window = cfg.get("sliding_window")
    num_layers = int(cfg["num_hidden_layers"])
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
    switched = qwen or arch == "SmolLM3ForCausalLM"  # the window counts only with use_sliding_window
    if not window or (switched and not cfg.get("use_sliding_window", False)):
        return None, None
    layer_types = cfg.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ModelLoadError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedModelError(f"layer types {unknown} are not supported (only sliding and full attention)")
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif qwen:
        layers = tuple(range(int(cfg.get("max_window_layers") or 0), num_layers))
    elif arch == "GptOssForCausalLM":  # transformers' default: every other layer slides, from the first
        layers = tuple(range(0, num_layers, 2))
    elif arch in _GEMMA_DEFAULT_PATTERN:
        pattern = int(cfg.get("sliding_window_pattern") or _GEMMA_DEFAULT_PATTERN[arch])
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    else:
        return int(window), None
    if not layers:
        return None, None
    return int(window), (None if len(layers) == num_layers else layers)


def _experts(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields: Mixtral's `num_local_experts`; Qwen3-MoE's and
    Qwen2-MoE's `num_experts` (`num_local_experts` as transformers 5.x writes it), their own
    expert width, `norm_topk_prob`, the layers that keep a dense MLP, Qwen2-MoE's and
    Qwen3.5-MoE's shared expert."""
    if arch == "GptOssForCausalLM":  # every layer sparse, each expert intermediate_size wide
        return {
            "num_experts": int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
        }
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        return {}
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    fields: dict[str, Any] = {"num_experts": num_experts, "num_experts_per_tok": int(cfg["num_experts_per_tok"])}
    if arch in ("Qwen2MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        fields["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size") or 0)
    if arch == "Qwen3_5MoeForCausalLM":  # every layer sparse, the chosen experts' weights always renormalized
        fields["moe_intermediate_size"] = int(cfg["moe_intermediate_size"])
        fields["norm_topk_prob"] = True
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
        step = int(cfg.get("decoder_sparse_step") or 1)
        only_dense = set(cfg.get("mlp_only_layers") or [])
        fields["moe_intermediate_size"] = int(cfg["moe_intermediate_size"])
        fields["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", arch == "Qwen3NextForCausalLM"))  # transformers' defaults
        fields["dense_mlp_layers"] = tuple(
            i for i in range(int(cfg["num_hidden_layers"])) if i in only_dense or (i + 1) % step
        )
    return fields


def rope_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings of either config dialect as one flat dict (rope_theta, rope_type,
    and the scaling's own keys). transformers 5.x writes `rope_parameters` with rope_theta
    inside; the checkpoints people download carry a top-level `rope_theta` and
    `rope_scaling` (whose type key is `type` in older files). A top-level
    `original_max_position_embeddings` (Phi-3) counts for the scaling."""
    settings: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if isinstance(value, dict):
            settings.update(value)
    if cfg.get("rope_theta") is not None and settings.get("rope_theta") is None:
        settings["rope_theta"] = cfg["rope_theta"]
    if "rope_type" not in settings and "type" in settings:
        settings["rope_type"] = settings["type"]
    if settings.get("rope_type") == "su":  # early Phi-3 128k configs' name for LongRoPE
        settings["rope_type"] = "longrope"
    if cfg.get("original_max_position_embeddings") is not None:
        settings["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return settings


def _rope_scaling(rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling | None:
    rope_type = rope.get("rope_type") or "default"
    if rope_type == "default":
        return None
    original = rope.get("original_max_position_embeddings")
    if original is None:  # as transformers fills it in
        original = max_position_embeddings
    factor = rope.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = max_position_embeddings / int(original)  # as DeepSeek's and Phi-3's configs leave it implied

    def factors(key: str) -> tuple[float, ...] | None:
        return None if rope.get(key) is None else tuple(float(v) for v in rope[key])

    def optional(key: str) -> float | None:
        return None if rope.get(key) is None else float(rope[key])

    return RopeScaling(
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
        short_factor=factors("short_factor"),
        long_factor=factors("long_factor"),
    )


def _eos_ids(cfg: dict[str, Any], folder: Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        sources.append(read_json(gen_path).get("eos_token_id"))
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
