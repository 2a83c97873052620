"""Model stage: the architecture names pagellm runs, as data: HF `architectures[0]`,
HF `model_type`, llama.cpp's `general.architecture`, and the names of base models and
sequence classifiers that run as a family's causal model.

Torch-free, so reading a checkpoint's metadata never imports the model classes; the
class of each name is model/registry.py's (a test holds the two in step).
"""

from __future__ import annotations

# HF `architectures[0]` of every causal model pagellm runs. Mistral and Qwen2 run as
# Llama; Phi-3/3.5/4 (dense) too (its fused qkv_proj and gate_up_proj are cut apart at
# load, loader/checkpoint_layouts.py; LongRoPE and partial rotary live in the rotary tables).
SUPPORTED_HF_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",  # Gemma 3 text models (gemma-3-1b; the text part of 4B+ as GGUF)
    "Qwen3_5ForCausalLM",  # Qwen3.5 / 3.6 dense: a hybrid (linear attention); the multimodal checkpoints' text part too
    "Qwen3_5MoeForCausalLM",  # ... and its mixture of experts (35B-A3B and larger)
    "Qwen3NextForCausalLM",  # Qwen3-Next: Qwen3.5-MoE's layers, its projections fused per key head
    "SmolLM3ForCausalLM",  # Llama's layers; every n-th has no rotary (NoPE)
    "GptOssForCausalLM",  # gpt-oss: attention sinks, sliding and full layers, biased experts with a clamped SwiGLU
    "Gemma4ForCausalLM",  # Gemma 4 text: per-layer inputs, KV-shared layers, global heads of their own shape
)
# A config saved without a model names no architecture; its model_type still says which.
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
}
# A multimodal checkpoint whose language model runs alone (its vision tower not loaded):
# its architecture (or model_type) -> the text model's, read from its text_config.
TEXT_MODEL_OF_MULTIMODAL = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",  # its vision and audio towers not loaded
    "gemma4": "Gemma4ForCausalLM",
}
# llama.cpp's `general.architecture` -> the HF architecture it was converted from.
ARCHITECTURE_BY_GGUF_NAME = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(ARCHITECTURE_BY_GGUF_NAME)
# A base model (e5-mistral's MistralModel, a Qwen3Model): the family's layers, no LM head.
BASE_MODEL_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}  # fmt: skip
# A sequence classifier (a cross-encoder reranker): the family's layers and a `score` head.
CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM", "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM", "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}  # fmt: skip


def hf_architecture(architecture: str, num_experts: int = 0) -> str:
    """The HF architecture a config's (HF or GGUF) architecture name runs as: a `llama`
    GGUF with experts is Mixtral (llama.cpp files it under `llama`)."""
    name = ARCHITECTURE_BY_GGUF_NAME.get(architecture, architecture)
    if name == "LlamaForCausalLM" and num_experts:
        return "MixtralForCausalLM"
    return name
