"""Tiny GGUF files written in the test run with the gguf package (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# Each tensor kind is stored in a different type, so one file covers them all.
QUANT_BY_KIND = {
    "token_embd": gguf.GGMLQuantizationType.Q8_0,
    "attn_q": gguf.GGMLQuantizationType.Q4_0,
    "attn_k": gguf.GGMLQuantizationType.Q4_1,
    "attn_v": gguf.GGMLQuantizationType.F16,
    "attn_output": gguf.GGMLQuantizationType.BF16,
    "ffn_gate": gguf.GGMLQuantizationType.Q8_0,
    "ffn_up": gguf.GGMLQuantizationType.Q4_1,
    "ffn_down": gguf.GGMLQuantizationType.Q4_0,
    "output": gguf.GGMLQuantizationType.F16,
}

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3: fused in the checkpoint and in the file
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor, as llama.cpp writes it
    "mlp.gate": "ffn_gate_inp",  # the experts' router
    "mlp.experts.gate_exps": "ffn_gate_exps",
    "mlp.experts.up_exps": "ffn_up_exps",
    "mlp.experts.down_exps": "ffn_down_exps",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",  # Qwen2-MoE
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# Gemma's layers have four norms; `ffn_norm` is the one before the MLP there.
_GEMMA_LAYER = {
    **_LAYER,
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA_ARCHES = ("gemma2", "gemma3")
# gpt-oss's: the norm before the MLP, the sinks (a `.weight` added by the converter).
_GPT_OSS_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks"}
QWEN35_ARCHES = ("qwen35", "qwen35moe", "qwen3next")  # Qwen3.5's tensors, and Qwen3-Next's
# Qwen3.5: the norm before the MLP is `post_attention_norm`; a Gated DeltaNet's tensors are
# `attn_qkv`/`attn_gate` and `ssm_*` (llama.cpp's gguf-py constants).
_QWEN35_LAYER = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "linear_attn.in_proj_ba": "ssm_ba",  # Qwen3-Next: b and a fused per key head, kept so
}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes (rotary pairs adjacent)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# K-quant blocks at these fp16 scale magnitudes give weights of about the checkpoint's size
# (|w| ~ 0.1-0.3): gguf cannot quantize to K types, so those tensors are random blocks.
_RANDOM_BLOCK_SCALE = {
    gguf.GGMLQuantizationType.Q4_K: 6e-4,
    gguf.GGMLQuantizationType.Q5_K: 3e-4,
    gguf.GGMLQuantizationType.Q6_K: 1.5e-4,
}


def write_gguf_from_hf(
    folder: Path, out: Path, cfg: dict, vocab: list[str] | None = None,
    quant_by_kind: dict[str, gguf.GGMLQuantizationType] | None = None, seed: int = 0, arch: str = "llama",
    pooling_type: gguf.PoolingType | None = None, mtp_blocks: int = 0,
) -> Path:
    """Convert a tiny HF Llama (or Qwen2/Qwen3/Phi-3/Qwen3.5: `arch` as llama.cpp names it) checkpoint to a
    GGUF file with mixed tensor types. As llama.cpp's converter does, only Llama's q/k rows
    are permuted into the interleaved rotary layout (the Qwen families rotate halves).
    Qwen3.5's tensors are changed as its converter changes them (_qwen35_converted); with
    `mtp_blocks`, random multi-token-prediction blocks follow the model's, as current
    converters write them.

    Tensors given a K-quant type (which the gguf package cannot quantize to) are written
    as random valid blocks instead: the file is then its own model, and a reference must
    load the GGUF itself (transformers does)."""
    tensors = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    if not (arch in QWEN35_ARCHES and mtp_blocks):
        writer.add_block_count(cfg["num_hidden_layers"])
    if pooling_type is not None:  # an embedding model's (llama.cpp's {arch}.pooling_type)
        writer.add_pooling_type(pooling_type)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    if arch != "qwen35moe":  # Qwen3.5-MoE's converter writes none: no layer has a dense MLP
        writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    if arch not in GEMMA_ARCHES:  # Gemma's: its global layers' (_add_gemma)
        writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    _add_rope_scaling(writer, cfg)
    if arch in GEMMA_ARCHES:
        _add_gemma(writer, cfg, arch)
    if arch in QWEN35_ARCHES:
        _add_qwen35(writer, cfg, arch)
    _add_vocabulary(writer, cfg["vocab_size"], vocab)
    types = QUANT_BY_KIND if quant_by_kind is None else quant_by_kind
    rng = np.random.default_rng(seed)
    if arch == "gpt-oss":
        tensors = _gpt_oss_converted(tensors, writer, cfg)
        for name in [n for n in tensors if n.endswith("_exps.mxfp4")]:  # stored bytes, written as they are
            gguf_name, _ = _gguf_name(name.removesuffix(".mxfp4") + ".weight", arch)
            writer.add_tensor(gguf_name, tensors.pop(name), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    else:
        tensors = _stack_experts(tensors, writer, cfg)
    if arch == "qwen3next":
        tensors = _split_qkvz(tensors, cfg)
    if arch in QWEN35_ARCHES and mtp_blocks:
        tensors = {**tensors, **_mtp_blocks(tensors, cfg, mtp_blocks, rng)}
        writer.add_block_count(cfg["num_hidden_layers"] + mtp_blocks)
        writer.add_nextn_predict_layers(mtp_blocks)
    for name, value in tensors.items():
        gguf_name, kind = _gguf_name(name, arch)
        value = value.astype(np.float32)
        if arch in GEMMA_ARCHES and name.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp's converter stores Gemma's norms as 1 + w
        if arch in QWEN35_ARCHES:
            value = _qwen35_converted(name, value, cfg, tiled=arch != "qwen3next")
        if kind == "attn_q" and arch in ("llama", "smollm3"):
            value = llama_cpp_permute(value, cfg["num_attention_heads"])
        elif kind == "attn_k" and arch in ("llama", "smollm3"):
            value = llama_cpp_permute(value, cfg["num_key_value_heads"])
        qtype = types.get(kind, gguf.GGMLQuantizationType.F32)
        if value.ndim == 1 or gguf_name.endswith(".bias"):
            qtype = gguf.GGMLQuantizationType.F32
        if qtype in _RANDOM_BLOCK_SCALE:
            from pagellm.bench.quant_blocks import random_blocks
            from pagellm.kernels.weights import WeightType

            data = random_blocks(WeightType(int(qtype)), value.shape[0], value.shape[1], rng, _RANDOM_BLOCK_SCALE[qtype])
        elif qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(value, qtype)
        else:
            data = value
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    _write_out(writer)
    return out


def _write_out(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_vocabulary(writer: gguf.GGUFWriter, vocab_size: int, vocab: list[str] | None = None) -> None:
    """A byte-level vocabulary (one token per byte value, spelled as GPT-2 does) unless
    `vocab` is given, and the tiny models' special ids."""
    writer.add_vocab_size(vocab_size)
    tokens = vocab or [_byte_char(b) for b in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # inside the tiny vocabulary (transformers defaults Phi-3 to 32000)


def _stack_experts(tensors: dict, writer: gguf.GGUFWriter, cfg: dict) -> dict:
    """Per-expert tensors (`mlp.experts.N.gate_proj`, Mixtral's `block_sparse_moe.experts.N.w1`)
    stacked into llama.cpp's [experts, rows, cols] tensors, with the expert metadata."""
    import re

    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not num_experts:
        return tensors
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    pattern = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
    kinds = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    rest = {}
    for name, value in tensors.items():
        match = pattern.match(name)
        if match is None:
            rest[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = value
        else:
            layer, expert, kind = match.groups()
            stacks.setdefault((layer, kinds[kind]), {})[int(expert)] = value
    for (layer, kind), experts in stacks.items():
        rest[f"model.layers.{layer}.mlp.experts.{kind}_exps.weight"] = np.stack([experts[e] for e in sorted(experts)])
    return rest


def _gpt_oss_converted(tensors: dict, writer: gguf.GGUFWriter, cfg: dict) -> dict:
    """gpt-oss's tensors as llama.cpp's converter writes an unquantized checkpoint: the
    experts' matrices transposed to [experts, out, in], gate and up (interleaved column by
    column in HF's) apart, their biases likewise, the router as `ffn_gate_inp`, the sinks as
    a weight; the window and the expert metadata."""
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    writer.add_sliding_window(cfg["sliding_window"])
    out = {}
    for name, value in tensors.items():
        prefix = name.rsplit(".mlp.", 1)[0]
        if name.endswith("_proj_scales"):
            continue  # with its blocks
        if name.endswith("_proj_blocks"):  # MXFP4 (OpenAI's folders): the bytes repacked, as llama.cpp's converter does
            stored = _mxfp4_gguf_blocks(value, tensors[name.replace("_blocks", "_scales")])
            if ".gate_up_proj" in name:  # rows interleave gate and up
                out[f"{prefix}.mlp.experts.gate_exps.mxfp4"], out[f"{prefix}.mlp.experts.up_exps.mxfp4"] = stored[:, 0::2], stored[:, 1::2]
            else:
                out[f"{prefix}.mlp.experts.down_exps.mxfp4"] = stored
        elif name.endswith(".mlp.experts.gate_up_proj"):
            value = value.transpose(0, 2, 1)
            out[f"{prefix}.mlp.experts.gate_exps.weight"], out[f"{prefix}.mlp.experts.up_exps.weight"] = value[:, 0::2], value[:, 1::2]
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            out[f"{prefix}.mlp.experts.gate_exps.bias"], out[f"{prefix}.mlp.experts.up_exps.bias"] = value[:, 0::2], value[:, 1::2]
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{prefix}.mlp.experts.down_exps.weight"] = value.transpose(0, 2, 1)
        elif name.endswith(".mlp.experts.down_proj_bias"):
            out[f"{prefix}.mlp.experts.down_exps.bias"] = value
        elif ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = value
        elif name.endswith(".self_attn.sinks"):
            out[name + ".weight"] = value
        else:
            out[name] = value
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def _mxfp4_gguf_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:  # uint8 [experts, rows, groups * 17]
    """OpenAI's MXFP4 (byte j of a group: elements 2j and 2j + 1) as GGML blocks (an exponent
    byte, then byte j: elements j and j + 16)."""
    low, high = blocks & 0x0F, blocks >> 4
    elements = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], 32)
    nibbles = elements[..., :16] | (elements[..., 16:] << 4)
    stored = np.concatenate([scales[..., None], nibbles], axis=-1)
    return stored.reshape(*blocks.shape[:2], -1)


def _add_qwen35(writer: gguf.GGUFWriter, cfg: dict, arch: str) -> None:
    """The linear-attention shapes and layer pattern as llama.cpp's converter writes them."""
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    if arch != "qwen3next":  # multimodal rotary sections (text positions ignore them): Qwen3.5's, or within a tiny head's
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        pairs = int(head_dim * (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25)) // 2
        writer.add_rope_dimension_sections([11, 11, 10, 0] if pairs >= 32 else [pairs - pairs // 2, pairs // 2, 0, 0])


def _split_qkvz(tensors: dict, cfg: dict) -> dict:
    """Qwen3-Next's in_proj_qkvz (per key head: q, k, v, z) as its converter writes it:
    attn_qkv (all q, all k, all v) and attn_gate (z)."""
    key_heads, key_dim = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    values = cfg["linear_num_value_heads"] // key_heads * cfg["linear_value_head_dim"]
    out = {}
    for name, value in tensors.items():
        if not name.endswith(".in_proj_qkvz.weight"):
            out[name] = value
            continue
        groups = value.reshape(key_heads, 2 * key_dim + 2 * values, -1)
        q, k, v, z = np.split(groups, np.cumsum([key_dim, key_dim, values]), axis=1)
        prefix = name.removesuffix("qkvz.weight")
        out[prefix + "qkv.weight"] = np.concatenate([part.reshape(-1, value.shape[1]) for part in (q, k, v)])
        out[prefix + "z.weight"] = z.reshape(-1, value.shape[1])
    return out


def _qwen35_converted(hf_name: str, value: np.ndarray, cfg: dict, tiled: bool) -> np.ndarray:
    """What llama.cpp's qwen35 (qwen3next) converter stores for an HF tensor: the (1 + w)
    norms with the 1 added (not the Gated DeltaNet's own norm), A_log as -exp(A_log), the
    conv weights squeezed to [channels, kernel], and (qwen35, `tiled`) every value-side
    tensor of a Gated DeltaNet with its value heads reordered from grouped (head g * r + j
    reads key head g) to tiled (head j * key_heads + g)."""
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return value + 1.0
    if ".linear_attn." not in hf_name:
        return value
    if not tiled:
        if hf_name.endswith(".A_log"):
            return -np.exp(value)
        return value.reshape(value.shape[0], value.shape[-1]) if ".conv1d." in hf_name else value
    key_heads, value_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    value_dim, qk_channels = cfg["linear_value_head_dim"], 2 * key_heads * cfg["linear_key_head_dim"]

    def tiled(rows: np.ndarray, head_size: int, axis: int = 0) -> np.ndarray:
        moved = np.moveaxis(rows, axis, 0)
        heads = moved.reshape(key_heads, value_heads // key_heads, head_size, *moved.shape[1:])
        return np.moveaxis(heads.swapaxes(0, 1).reshape(moved.shape), 0, axis)

    if hf_name.endswith(".A_log"):
        return tiled(-np.exp(value), 1)
    if hf_name.endswith(".dt_bias") or ".in_proj_b." in hf_name or ".in_proj_a." in hf_name:
        return tiled(value, 1)
    if ".in_proj_z." in hf_name:
        return tiled(value, value_dim)
    if ".in_proj_qkv." in hf_name:
        return np.concatenate([value[:qk_channels], tiled(value[qk_channels:], value_dim)])
    if ".conv1d." in hf_name:
        value = value.reshape(value.shape[0], value.shape[-1])
        return np.concatenate([value[:qk_channels], tiled(value[qk_channels:], value_dim)])
    if ".out_proj." in hf_name:
        return tiled(value, value_dim, axis=1)
    return value  # the gated norm: one weight for every head


def _mtp_blocks(tensors: dict, cfg: dict, count: int, rng: np.random.Generator) -> dict:
    """Random multi-token-prediction blocks after the model's layers (a full-attention
    layer's tensors and the `nextn.*` ones): a loader must leave them out."""
    template = cfg["num_hidden_layers"] - 1  # the last layer attends
    blocks = {}
    for block in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + count):
        for name, value in tensors.items():
            if name.startswith(f"model.layers.{template}."):
                blocks[name.replace(f".{template}.", f".{block}.", 1)] = rng.normal(0.0, 1.0, value.shape).astype(np.float32)
        hidden = cfg["hidden_size"]
        blocks[f"model.layers.{block}.nextn.eh_proj.weight"] = rng.normal(0.0, 1.0, (hidden, 2 * hidden)).astype(np.float32)
        blocks[f"model.layers.{block}.nextn.enorm.weight"] = np.ones(hidden, np.float32)
    return blocks


def _add_rope_scaling(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """YaRN and LongRoPE as llama.cpp's converter writes them."""
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "longrope":  # Phi-3: the factors as two tensors, the original context as metadata
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _add_gemma(writer: gguf.GGUFWriter, cfg: dict, arch: str) -> None:
    """What llama.cpp's converter writes for Gemma 2/3: the window, Gemma 2's caps; the
    sliding pattern, attention scale and Gemma 3's local rotary base stay implied."""
    writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
    rope = cfg.get("rope_parameters") or {}
    global_rope = rope.get("full_attention", rope)
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    if "rope_theta" in global_rope:
        writer.add_rope_freq_base(global_rope["rope_theta"])


def _gguf_name(hf_name: str, arch: str = "llama") -> tuple[str, str]:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", "token_embd"
    if hf_name == "model.norm.weight":
        return "output_norm.weight", "output_norm"
    if hf_name == "lm_head.weight":
        return "output.weight", "output"
    _, _, layer, rest = hf_name.split(".", 3)
    if arch in QWEN35_ARCHES:
        if rest == "linear_attn.A_log":
            return f"blk.{layer}.ssm_a", "ssm_a"  # no suffix: not a weight llama.cpp multiplies by
        if rest == "linear_attn.dt_bias":
            return f"blk.{layer}.ssm_dt.bias", "ssm_dt"
        if rest.startswith("nextn."):
            return f"blk.{layer}.{rest}", "nextn"
    module, suffix = rest.rsplit(".", 1)
    layers = _GEMMA_LAYER if arch in GEMMA_ARCHES else _QWEN35_LAYER if arch in QWEN35_ARCHES else _LAYER
    if arch == "gpt-oss":
        layers = _GPT_OSS_LAYER
    kind = layers[module]
    return f"blk.{layer}.{kind}.{suffix}", kind


def _byte_char(b: int) -> str:
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def write_gguf_lora_from_peft(peft_folder: Path, out: Path, cfg: dict, arch: str = "llama") -> Path:
    """A PEFT LoRA folder as llama.cpp's convert_lora_to_gguf.py writes it: general.type
    adapter, adapter.lora.alpha, `blk.N.<kind>.weight.lora_a` / `.lora_b` in F32, a Llama's q
    and k B rows permuted as the base's are."""
    adapter_config = json.loads((peft_folder / "adapter_config.json").read_text())
    tensors = load_file(str(peft_folder / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(adapter_config["lora_alpha"]))
    for key, value in sorted(tensors.items()):
        module, ab = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        gguf_name, kind = _gguf_name(module + ".weight", arch)
        value = np.asarray(value, dtype=np.float32)
        if ab.startswith("B") and arch == "llama" and kind in ("attn_q", "attn_k"):
            value = llama_cpp_permute(value, cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"])
        writer.add_tensor(f"{gguf_name}.lora_{ab[0].lower()}", np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Gemma 4's tensors as llama.cpp's gguf-py maps them (its norms stored as they are: w, not 1 + w).
_GEMMA4_LAYER = {
    **_GEMMA_LAYER,
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "router.proj": "ffn_gate_inp",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
}
_GEMMA4_GLOBAL = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def write_gemma4_gguf(
    folder: Path, out: Path, cfg: dict, quant_by_kind: dict[str, gguf.GGMLQuantizationType] | None = None
) -> Path:
    """A tiny HF Gemma 4 as llama.cpp's converter writes it: the global layers' head size
    as key_length (the sliding ones' as key_length_swa), per-layer KV head counts and MLP
    widths as arrays where they differ, one sliding flag per layer, the shared layers'
    count, the per-layer input width; "proportional" rotary as a rope_freqs tensor (1 for a
    turning frequency, 1e30 for the others); the router's scale as `ffn_gate_inp.scale`, the
    per-expert scale as `ffn_down_exps.scale`, the experts stacked (`ffn_gate_up_exps`),
    each layer's scalar as `layer_output_scale.weight`."""
    tensors = load_file(str(folder / "model.safetensors"))
    arch = "gemma4"
    writer = gguf.GGUFWriter(str(out), arch)
    layers = cfg["num_hidden_layers"]
    sliding = [kind == "sliding_attention" for kind in cfg["layer_types"]]
    per_layer = cfg.get("per_layer_config") or {}
    global_shape = next(iter(per_layer.values()), {})
    head_dim = cfg["head_dim"]
    global_head_dim = global_shape.get("head_dim", head_dim)
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    first_shared = layers - cfg.get("num_kv_shared_layers", 0)
    widths = [cfg["intermediate_size"] * (2 if cfg.get("use_double_wide_mlp") and i >= first_shared else 1) for i in range(layers)]
    writer.add_feed_forward_length(widths if len(set(widths)) > 1 else widths[0])
    writer.add_head_count(cfg["num_attention_heads"])
    kv_heads = [cfg["num_key_value_heads"] if flag else global_shape.get("num_key_value_heads", cfg["num_key_value_heads"]) for flag in sliding]
    writer.add_head_count_kv(kv_heads if len(set(kv_heads)) > 1 else kv_heads[0])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(head_dim)
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(cfg.get("num_kv_shared_layers", 0))
    writer.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("enable_moe_block"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["top_k_experts"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _add_vocabulary(writer, cfg["vocab_size"])
    turning = int(global_head_dim * rope["full_attention"].get("partial_rotary_factor", 1.0) / 2)
    divisors = [1.0] * turning + [1e30] * (global_head_dim // 2 - turning)
    writer.add_tensor("rope_freqs.weight", np.asarray(divisors, dtype=np.float32))
    types = quant_by_kind or {}
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if name in _GEMMA4_GLOBAL:
            gguf_name, kind = _GEMMA4_GLOBAL[name], _GEMMA4_GLOBAL[name].split(".")[0]
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            if rest == "layer_scalar":
                gguf_name, kind = f"blk.{layer}.layer_output_scale.weight", "layer_output_scale"
            elif rest == "router.scale":
                gguf_name, kind = f"blk.{layer}.ffn_gate_inp.scale", "router_scale"
            elif rest == "router.per_expert_scale":
                gguf_name, kind = f"blk.{layer}.ffn_down_exps.scale", "expert_scale"
            elif rest in ("experts.gate_up_proj", "experts.down_proj"):
                kind = "ffn_gate_up_exps" if "gate_up" in rest else "ffn_down_exps"
                gguf_name = f"blk.{layer}.{kind}.weight"
            else:
                module, suffix = rest.rsplit(".", 1)
                kind = _GEMMA4_LAYER[module]
                gguf_name = f"blk.{layer}.{kind}.{suffix}"
        else:
            gguf_name, kind = _gguf_name(name, arch)
        qtype = types.get(kind, gguf.GGMLQuantizationType.F32)
        if value.ndim == 1:
            qtype = gguf.GGMLQuantizationType.F32
        data = value if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(value, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    _write_out(writer)
    return out
