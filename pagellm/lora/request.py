"""Lora stage: which adapter a request runs under (vLLM's LoRARequest, same fields)."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, number and location. `lora_int_id` is its identity: requests with
    the same id share the adapter's slot and their prefix-cache blocks; it must be >= 1
    (0 is the base model). `lora_path`: a PEFT folder (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}", "lora_request")
        if not self.lora_name:
            raise InvalidRequestError("lora_name must not be empty", "lora_request")
