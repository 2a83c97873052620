"""Tiny random-weight HF checkpoints built in the test run (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagellm.bench.synthetic_model import write_byte_tokenizer

TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


# Qwen3.5's hybrid layers at a tiny size: four layers (three linear-attention, one gated
# attention), value heads sharing q/k heads.
QWEN3_5_SHAPE = dict(
    num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, pad_token_id=0,
)  # fmt: skip


# gpt-oss at a tiny size: 4 experts (top 2), a window of 8 tokens in the first of each two
# layers, a SwiGLU clamp (1.0) below the experts' typical gate and up values, and YaRN
# whose original context (128) lies inside the model's.
GPT_OSS_SHAPE = dict(
    num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0, head_dim=16,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0},
)  # fmt: skip


# Gemma 4 at a tiny size: six layers (sliding, sliding, full, three times), the last two
# reading the K/V of layers 3 (sliding) and 2 (full), per-layer inputs 8 wide, global heads
# twice the sliding ones' size (so two sliding layers share a cache tensor's width), the
# shared layers' MLPs double-wide, a window of 8, "proportional" rotary on the global layers.
GEMMA4_SHAPE = dict(
    num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, use_double_wide_mlp=True,
    final_logit_softcapping=30.0, pad_token_id=0, tie_word_embeddings=True,
)  # fmt: skip
# ... and the 26B-A4B / 31B kind: keys as values in the global layers (one KV head, so
# two global layers share a cache tensor's width), experts beside every MLP, no sharing.
GEMMA4_MOE_SHAPE = dict(
    num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=0,
    hidden_size_per_layer_input=0, use_double_wide_mlp=False, enable_moe_block=True, num_experts=4,
    top_k_experts=2, moe_intermediate_size=32,
)  # fmt: skip


def make_tiny_hf_checkpoint(
    folder: Path, arch: str = "llama", seed: int = 0, **overrides: object
) -> Path:
    """Save a random tiny Llama/Qwen2/Mistral/Qwen3/Phi-3/Mixtral/Qwen3-MoE/Gemma 2/Gemma 3/
    Qwen3.5/Qwen3-Next/SmolLM3/gpt-oss model as an HF folder; return its path."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    shape = {**TINY_SHAPE, "rope_theta": 10000.0, "tie_word_embeddings": False}
    shape.update(overrides)
    if arch in ("mistral", "phi3", "mixtral"):
        shape.setdefault("sliding_window", None)
    if arch == "gemma4":
        shape = {**shape, **GEMMA4_SHAPE, **overrides}
        shape.pop("rope_theta")  # rope_parameters by layer kind (transformers' defaults)
    elif arch.startswith("gemma"):
        # Gemma's own head size (256 by default) and window (4096) are too large here.
        shape.setdefault("head_dim", 16)
        shape.setdefault("query_pre_attn_scalar", 16)
        shape.setdefault("sliding_window", 8)
        shape.setdefault("pad_token_id", 0)
    if arch in ("phi3", "smollm3"):
        shape.setdefault("pad_token_id", 0)  # its default (32000, 128004) lies outside the tiny vocabulary
    if arch.startswith(("qwen3_5", "qwen3_next")):
        # Three linear-attention layers and a gated attention one (its own default order),
        # GQA-like sharing of q/k heads by value heads, and heads small enough to be quick.
        shape.update({**QWEN3_5_SHAPE, **overrides})
    if arch == "gpt_oss":
        shape = {**shape, **GPT_OSS_SHAPE, **overrides}
        shape.pop("rope_theta")  # inside rope_parameters
    config = config_cls(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Default init leaves tiny weights whose greedy output collapses into repeating one
    # token; wider weights make the output varied, so a mismatch would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)  # Gemma 4's learned multipliers
            elif "norm" in name:
                # Gemma's norms scale by (1 + w) (Gemma 4's by w): the same spread around 1.
                offset = arch in ("gemma2", "gemma3") or (arch.startswith(("qwen3_5", "qwen3_next")) and "linear_attn.norm" not in name)
                param.uniform_(-0.2, 0.2) if offset else param.uniform_(0.8, 1.2)
            elif "embed" in name:
                # A tied head reads the embedding too: keep it moderate there.
                # Gemma 4 multiplies it by sqrt(hidden) on the way in: smaller still, or
                # each token's own embedding would outweigh the layers and repeat itself.
                std = 0.3 if config.tie_word_embeddings else 1.0
                param.normal_(0.0, std / 4 if arch == "gemma4" and name.endswith("embed_tokens.weight") else std)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("sinks"):
                # gpt-oss's sink logits, of the scores' size: they take a share of every softmax.
                param.normal_(0.0, 1.5)
            else:
                param.normal_(0.0, 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's output multiplier per layer
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)  # one token per byte, as the tiny vocabulary of 256
    return folder


def load_hf_reference(folder: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def make_tiny_classifier_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, num_labels: int = 1) -> Path:
    """A random tiny *ForSequenceClassification (a cross-encoder reranker's shape) saved as
    an HF folder: the family's layers and a `score` head of `num_labels` rows."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification),
    }
    config_cls, model_cls = classes[arch]
    config = config_cls(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=num_labels, rope_theta=10000.0,
        tie_word_embeddings=False, **TINY_SHAPE,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif "embed" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder


def make_tiny_qwen3_5_multimodal(folder: Path, seed: int = 0) -> Path:
    """A random tiny Qwen3_5ForConditionalGeneration (a one-block vision tower beside the
    hybrid language model of make_tiny_hf_checkpoint(..., "qwen3_5")), saved as transformers
    5.x writes it: the language model under model.language_model, the tower under model.visual."""
    import transformers

    text = {**TINY_SHAPE, **QWEN3_5_SHAPE, "bos_token_id": 1, "eos_token_id": 2}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 4, "num_position_embeddings": 16}  # fmt: skip
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
        vision_start_token_id=252, vision_end_token_id=253,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "visual" not in name:
                param.uniform_(0.8, 1.2) if "linear_attn.norm" in name else param.uniform_(-0.2, 0.2)
            elif "embed" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder


def load_hf_multimodal_reference(folder: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def make_tiny_gpt_oss_mxfp4(root: Path, seed: int = 5, **overrides: object) -> tuple[Path, Path]:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 as OpenAI's folders store them
    (`*_blocks` [experts, rows, groups, 16], byte j = elements 2j | 2j + 1 << 4, `*_scales`
    [experts, rows, groups] E8M0 exponents; rows = output features, gate and up interleaved),
    and the same model in float32 with the experts' dequantized values (the reference).
    Returns (MXFP4 folder, float folder)."""
    import gguf
    from safetensors.torch import load_file, save_file

    reference = make_tiny_hf_checkpoint(root / "float", "gpt_oss", seed=seed, **overrides)
    tensors = load_file(str(reference / "model.safetensors"))
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors[name].transpose(1, 2).contiguous().numpy()  # [experts, out, in]
        experts, rows, k = weight.shape
        blocks = gguf.quants.quantize(weight.reshape(-1, k), gguf.GGMLQuantizationType.MXFP4)
        blocks = blocks.reshape(experts, rows, k // 32, 17)
        values = gguf.quants.dequantize(blocks.reshape(experts * rows, -1), gguf.GGMLQuantizationType.MXFP4)
        tensors[name] = torch.from_numpy(values.reshape(experts, rows, k).astype("float32")).transpose(1, 2).contiguous()
        codes = torch.from_numpy(blocks[..., 1:].copy())
        elements = torch.cat([codes & 0x0F, codes >> 4], dim=-1)  # llama.cpp's order: j, then j + 16
        packed[name + "_blocks"] = (elements[..., 0::2] | (elements[..., 1::2] << 4)).contiguous()
        packed[name + "_scales"] = torch.from_numpy(blocks[..., 0].copy())
    save_file(tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})
    folder = root / "mxfp4"
    folder.mkdir()
    quantized = {name: value for name, value in tensors.items() if not name.endswith(("gate_up_proj", "down_proj"))}
    save_file({**quantized, **packed}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((reference / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    for extra in reference.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (folder / extra.name).write_bytes(extra.read_bytes())
    return folder, reference


# Harmony's special tokens, after the tiny vocabulary's 256 bytes (as gpt-oss's vocabulary
# has them, one token each; <|return|> and <|call|> end a turn).
HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>", "<|endoftext|>")


def make_tiny_harmony_model(folder: Path, seed: int = 5) -> Path:
    """A tiny gpt-oss whose tokenizer has harmony's special tokens (ids 256-263), ending its
    turn at <|return|> or <|call|>: what the server renders and parses harmony for."""
    from tokenizers import AddedToken, Tokenizer

    # A context for harmony's system and developer messages (one token per byte here).
    make_tiny_hf_checkpoint(folder, "gpt_oss", seed=seed, vocab_size=256 + len(HARMONY_SPECIALS), max_position_embeddings=2048)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in HARMONY_SPECIALS])
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|return|>"  # as gpt-oss's (the byte tokenizer's is byte 2)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")]
    (folder / "config.json").write_text(json.dumps(config))
    generation = folder / "generation_config.json"
    if generation.is_file():
        settings = json.loads(generation.read_text())
        settings["eos_token_id"] = config["eos_token_id"]
        generation.write_text(json.dumps(settings))
    return folder
