"""Test helper: LoRA adapters written by `peft` itself over a tiny HF checkpoint, with random
non-zero weights (peft's own init leaves B at zero, which would hide every mistake), and
HF + PEFT greedy tokens as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    base: Path, out: Path, rank: int, targets: list[str], seed: int, alpha: int = 16, scale: float = 0.3, **extra: object
) -> Path:
    """Save a PEFT LoRA adapter for the checkpoint at `base` into `out`."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * scale)
    wrapped.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):  # noqa: ANN201 - peft.PeftModel, unmerged
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).eval()
