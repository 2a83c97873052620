"""Model stage: which model class runs each architecture (the names are data in
model/checkpoint/architectures.py).

A new family is one module (a subclass of LlamaForCausalLM where the family differs only
inside a layer) plus a line here and its names there; an architecture not listed is
refused at start with the list of those that are.
"""

from __future__ import annotations

from pagellm.config.model import ModelConfig
from pagellm.errors import UnsupportedModelError
from pagellm.model.checkpoint.architectures import SUPPORTED_HF_ARCHITECTURES, hf_architecture
from pagellm.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagellm.model.gemma4 import Gemma4ForCausalLM
from pagellm.model.gpt_oss import GptOssForCausalLM
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.mixture_of_experts import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagellm.model.qwen3 import Qwen3ForCausalLM
from pagellm.model.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

# HF `architectures[0]` -> the class that runs it.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    # The same computation: its fused projections are cut apart at load (loader/checkpoint_layouts.py).
    "Qwen3NextForCausalLM": Qwen3_5MoeForCausalLM,
    # Llama's layers; its NoPE layers are ModelConfig.nope_layers, read by the attention.
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class for a config's HF or GGUF architecture name."""
    name = hf_architecture(config.architecture, config.num_experts)
    if name not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    return MODEL_CLASSES[name]
