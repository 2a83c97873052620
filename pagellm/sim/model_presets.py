"""Sim stage: model shapes for the roofline cost model, from each checkpoint's
own config.json (the Hugging Face repository named in its `source`).

Only the shape matters to a cost model (layers, widths, heads, vocabulary); presets are
ordinary ModelConfig objects, so the same arithmetic serves a checkpoint loaded with
pagellm.model.loader.load_model_config.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.errors import ConfigError
from pagellm.config.model import LinearAttentionSpec, ModelConfig, RopeScaling


@dataclass(frozen=True)
class ModelPreset:
    name: str
    config: ModelConfig
    dtype_bytes: int  # bytes per weight and per KV element (the checkpoints are bfloat16)
    source: str


def _preset(name: str, repo: str, architecture: str, **shape: object) -> ModelPreset:
    config = ModelConfig(architecture=architecture, **shape)  # type: ignore[arg-type]
    fields = ", ".join(
        f"{key}={value}" for key, value in shape.items()
        if key not in ("rms_norm_eps", "rope_scaling", "qk_norm", "norm_topk_prob", "sliding_window_layers", "nope_layers")
    )
    return ModelPreset(name, config, 2, f"huggingface.co/{repo} config.json: {fields}, bfloat16")


def _hybrid_preset(
    name: str, repo: str, architecture: str, linear: dict[str, int], **shape: object
) -> ModelPreset:
    """A Qwen3.5 / Qwen3-Next hybrid: every `full_attention_interval`-th layer attends (gated,
    q/k norms, rotary on a quarter of each head), the others are Gated DeltaNets shaped by
    the config's `linear_*` keys (named so in the source)."""
    layers = int(shape["num_hidden_layers"])  # type: ignore[call-overload]
    interval = linear.pop("full_attention_interval")
    spec = LinearAttentionSpec(
        layers=tuple(i for i in range(layers) if (i + 1) % interval),
        num_key_heads=linear["linear_num_key_heads"], num_value_heads=linear["linear_num_value_heads"],
        key_head_dim=linear["linear_key_head_dim"], value_head_dim=linear["linear_value_head_dim"],
        conv_kernel_size=linear["linear_conv_kernel_dim"],
    )  # fmt: skip
    preset = _preset(
        name, repo, architecture, **shape, linear_attention=spec, attention_output_gate=True, norm_weight_offset=True,
        qk_norm=True, partial_rotary_factor=0.25,
    )  # fmt: skip
    described = ", ".join(f"{key}={value}" for key, value in {"full_attention_interval": interval, **linear}.items())
    source = preset.source.split(", linear_attention=")[0] + f", {described}, partial_rotary_factor=0.25, bfloat16"
    return ModelPreset(preset.name, preset.config, preset.dtype_bytes, source)


# gpt-oss's YaRN, as its config.json has it.
_GPT_OSS_ROPE = RopeScaling(
    "yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False
)


def _gpt_oss_preset(name: str, repo: str, num_hidden_layers: int, num_experts: int) -> ModelPreset:
    """gpt-oss-20b and -120b differ only in depth and experts (their config.json files)."""
    return _preset(
        name, repo, "GptOssForCausalLM",
        vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=num_hidden_layers, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072, tie_word_embeddings=False,
        num_experts=num_experts, num_experts_per_tok=4, moe_intermediate_size=2880, expert_bits_per_weight=4.25,
        sliding_window=128, sliding_window_layers=tuple(range(0, num_hidden_layers, 2)), rope_theta=150000.0,
        rope_scaling=_GPT_OSS_ROPE, attention_bias=True, attention_out_bias=True, attention_sinks=True,
        expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702, softmax_after_topk=True, rms_norm_eps=1e-5,
    )  # fmt: skip
def _gemma4_preset(name: str, repo: str, num_hidden_layers: int, sliding_window: int, **shape: object) -> ModelPreset:
    """Gemma 4 (the text model of each multimodal checkpoint's config.json): five sliding
    layers to one global, global heads of 512 turning a quarter of their frequencies
    ("proportional" rotary), 256-wide sliding heads, logits soft-capped at 30."""
    hidden = int(shape["hidden_size"])  # type: ignore[call-overload]
    return _preset(
        name, repo, "Gemma4ForCausalLM", vocab_size=262144, num_hidden_layers=num_hidden_layers, head_dim=256,
        global_head_dim=512, max_position_embeddings=131072, tie_word_embeddings=True, hidden_activation="gelu_tanh",
        sliding_window=sliding_window, sliding_window_layers=tuple(i for i in range(num_hidden_layers) if (i + 1) % 6),
        rope_theta=1000000.0, local_rope_theta=10000.0, global_rotated_share=0.25, qk_norm=True, value_norm=True,
        embedding_multiplier=hidden**0.5, attention_scale=1.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6, **shape,
    )  # fmt: skip


# Llama 3.1's long-context rotary scaling, as its config.json has it.
_LLAMA31_ROPE = RopeScaling(
    "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

MODEL_PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        _preset(
            "Llama-3-8B", "meta-llama/Meta-Llama-3-8B", "LlamaForCausalLM",
            vocab_size=128256, hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        ),
        _preset(
            "Llama-3-70B", "meta-llama/Meta-Llama-3-70B", "LlamaForCausalLM",
            vocab_size=128256, hidden_size=8192, intermediate_size=28672,
            num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        ),
        _preset(
            "Llama-3.1-8B", "meta-llama/Llama-3.1-8B", "LlamaForCausalLM",
            vocab_size=128256, hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False,
            rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5,
        ),
        _preset(
            "Llama-3.1-70B", "meta-llama/Llama-3.1-70B", "LlamaForCausalLM",
            vocab_size=128256, hidden_size=8192, intermediate_size=28672,
            num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=131072, tie_word_embeddings=False,
            rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5,
        ),
        _preset(
            "Qwen3-8B", "Qwen/Qwen3-8B", "Qwen3ForCausalLM",
            vocab_size=151936, hidden_size=4096, intermediate_size=12288,
            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
            rope_theta=1000000.0, qk_norm=True, rms_norm_eps=1e-6,
        ),
        _preset(
            "Qwen3-32B", "Qwen/Qwen3-32B", "Qwen3ForCausalLM",
            vocab_size=151936, hidden_size=5120, intermediate_size=25600,
            num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
            rope_theta=1000000.0, qk_norm=True, rms_norm_eps=1e-6,
        ),
        _preset(
            "Phi-4", "microsoft/phi-4", "Phi3ForCausalLM",
            vocab_size=100352, hidden_size=5120, intermediate_size=17920,
            num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
            head_dim=128, max_position_embeddings=16384, tie_word_embeddings=False,
            rope_theta=250000.0, rms_norm_eps=1e-5,
        ),
        _preset(
            "Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1", "MixtralForCausalLM",
            vocab_size=32000, hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=32768, tie_word_embeddings=False,
            num_experts=8, num_experts_per_tok=2, rope_theta=1000000.0, rms_norm_eps=1e-5,
        ),
        _preset(
            "Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", "Qwen3MoeForCausalLM",
            vocab_size=151936, hidden_size=2048, intermediate_size=6144,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            rope_theta=1000000.0, qk_norm=True, norm_topk_prob=True, rms_norm_eps=1e-6,
        ),
        # Gemma: every other layer (Gemma 2) or five of every six (Gemma 3) slide.
        _preset(
            "Gemma-2-9B", "google/gemma-2-9b", "Gemma2ForCausalLM",
            vocab_size=256000, hidden_size=3584, intermediate_size=14336,
            num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
            head_dim=256, max_position_embeddings=8192, tie_word_embeddings=True,
            sliding_window=4096, sliding_window_layers=tuple(range(0, 42, 2)), rms_norm_eps=1e-6,
        ),
        _preset(
            "Gemma-3-27B", "google/gemma-3-27b-pt", "Gemma3ForCausalLM",
            vocab_size=262208, hidden_size=5376, intermediate_size=21504,
            num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
            head_dim=128, max_position_embeddings=131072, tie_word_embeddings=True,
            sliding_window=1024, sliding_window_layers=tuple(i for i in range(62) if (i + 1) % 6),
            rope_theta=1000000.0, local_rope_theta=10000.0, rope_scaling=RopeScaling("linear", factor=8.0),
            qk_norm=True, rms_norm_eps=1e-6,
        ),
        # gpt-oss: every layer sparse (top 4), sliding (128) and full layers alternating, the
        # experts in MXFP4 (4.25 bits per weight) as OpenAI ships them, the rest bfloat16.
        _gpt_oss_preset("gpt-oss-20b", "openai/gpt-oss-20b", num_hidden_layers=24, num_experts=32),
        _gpt_oss_preset("gpt-oss-120b", "openai/gpt-oss-120b", num_hidden_layers=36, num_experts=128),
        # Gemma 4: E4B's last 18 layers read earlier layers' K/V (24 of 42 layers hold a KV
        # cache) and every layer adds a 256-wide per-layer input; 31B and 26B-A4B use keys as
        # values in their global layers (4 and 2 KV heads there), 26B-A4B runs 128 experts
        # (top 8) beside each layer's MLP.
        _gemma4_preset(
            "Gemma-4-E4B", "google/gemma-4-E4B-it", num_hidden_layers=42, sliding_window=512, hidden_size=2560,
            intermediate_size=10240, num_attention_heads=8, num_key_value_heads=2, num_kv_shared_layers=18,
            per_layer_input_size=256, per_layer_input_vocab_size=262144,
        ),
        _gemma4_preset(
            "Gemma-4-31B", "google/gemma-4-31B-it", num_hidden_layers=60, sliding_window=1024, hidden_size=5376,
            intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
            attention_k_eq_v=True,
        ),
        _gemma4_preset(
            "Gemma-4-26B-A4B", "google/gemma-4-26B-A4B-it", num_hidden_layers=30, sliding_window=1024, hidden_size=2816,
            intermediate_size=2112, num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
            attention_k_eq_v=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=704,
            norm_topk_prob=True, experts_beside_mlp=True,
        ),
        # SmolLM3: Llama's shape; every fourth layer without rotary (NoPE) costs the same.
        _preset(
            "SmolLM3-3B", "HuggingFaceTB/SmolLM3-3B", "SmolLM3ForCausalLM",
            vocab_size=128256, hidden_size=2048, intermediate_size=11008,
            num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
            head_dim=128, max_position_embeddings=65536, tie_word_embeddings=True,
            rope_theta=5000000.0, nope_layers=tuple(range(3, 36, 4)), rms_norm_eps=1e-6,
        ),
        _preset(
            "Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", "Qwen2ForCausalLM",
            vocab_size=152064, hidden_size=3584, intermediate_size=18944,
            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
            head_dim=128, max_position_embeddings=32768, tie_word_embeddings=False,
            attention_bias=True, rms_norm_eps=1e-6,
        ),
        # Hybrids: Gated DeltaNet linear attention in three layers of four (a fixed-size
        # state per request), gated full attention in the fourth. Qwen3.5-35B-A3B's config
        # has no intermediate_size (every layer sparse): the expert width stands in.
        _hybrid_preset(
            "Qwen3.5-27B", "Qwen/Qwen3.5-27B", "Qwen3_5ForCausalLM",
            {"full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48},
            vocab_size=248320, hidden_size=5120, intermediate_size=17408,
            num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
            head_dim=256, max_position_embeddings=262144, tie_word_embeddings=False,
            rope_theta=10000000.0, rms_norm_eps=1e-6,
        ),
        _hybrid_preset(
            "Qwen3.5-35B-A3B", "Qwen/Qwen3.5-35B-A3B", "Qwen3_5MoeForCausalLM",
            {"full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32},
            vocab_size=248320, hidden_size=2048, intermediate_size=512,
            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
            head_dim=256, max_position_embeddings=262144, tie_word_embeddings=False,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            norm_topk_prob=True, rope_theta=10000000.0, rms_norm_eps=1e-6,
        ),
        _hybrid_preset(
            "Qwen3-Next-80B-A3B", "Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen3NextForCausalLM",
            {"full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32},
            vocab_size=151936, hidden_size=2048, intermediate_size=5120,
            num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
            head_dim=256, max_position_embeddings=262144, tie_word_embeddings=False,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            norm_topk_prob=True, rope_theta=10000000.0, rms_norm_eps=1e-6,
        ),
        _preset(
            "SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", "LlamaForCausalLM",
            vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
    )
}  # fmt: skip


def get_model_preset(name: str) -> ModelPreset:
    """The preset named `name` (case-insensitive)."""
    for key, preset in MODEL_PRESETS.items():
        if key.lower() == name.lower():
            return preset
    raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(MODEL_PRESETS)}")
