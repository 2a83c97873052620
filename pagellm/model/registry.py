"""Model stage: which model class runs each architecture, by its HF and its GGUF name.

A new family is one module (a subclass of LlamaForCausalLM where the family differs only
inside a layer) plus a line here; an architecture not listed is refused at start with the
list of those that are.
"""

from __future__ import annotations

from pagellm.config.model import ModelConfig
from pagellm.errors import UnsupportedModelError
from pagellm.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.mixture_of_experts import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagellm.model.qwen3 import Qwen3ForCausalLM

# HF `architectures[0]` -> the class that runs it.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Phi-3/3.5/4 (dense): Llama's layer; its fused qkv_proj and gate_up_proj are cut apart
    # at load (loader/checkpoint_layouts.py), its LongRoPE and partial rotary live in the rotary tables.
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # Gemma 3 text models (gemma-3-1b; the text part of 4B+ as GGUF)
}
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
}
SUPPORTED_HF_ARCHITECTURES = tuple(MODEL_CLASSES)
SUPPORTED_GGUF_ARCHITECTURES = tuple(ARCHITECTURE_BY_GGUF_NAME)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class for a config's HF or GGUF architecture name (a `llama` GGUF with experts
    is Mixtral: llama.cpp files it under `llama`)."""
    name = ARCHITECTURE_BY_GGUF_NAME.get(config.architecture, config.architecture)
    if name == "LlamaForCausalLM" and config.num_experts:
        name = "MixtralForCausalLM"
    if name not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    return MODEL_CLASSES[name]
