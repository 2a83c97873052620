"""Lora stage: LoRA adapters served over one base model (lora/request.py LoRARequest; the adapters'
files in lora/adapter.py, their slots beside the model in lora/slots.py)."""

from pagellm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
