"""Model stage: the architectures the model implementations cover."""

from __future__ import annotations

# Architectures the one Llama-family implementation covers; the differences between
# them are all expressed by ModelConfig fields (biases, tying, rope, sliding window).
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
