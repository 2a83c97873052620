"""Lora stage: a LoRA adapter in a GGUF file (llama.cpp's convert_lora_to_gguf.py), read into
the names and shapes of a PEFT folder so that lora/adapter.py takes either.

Such a file says `general.type = adapter`, `adapter.type = lora` and `adapter.lora.alpha`;
each adapted base tensor `blk.N.attn_q.weight` has `blk.N.attn_q.weight.lora_a` [r, in] and
`.lora_b` [out, r] (in numpy order, as PEFT's A and B). llama.cpp's converter permutes the
rows of a Llama base's q and k for its interleaved rotary layout, and a LoRA's B with them:
those rows are put back in HF order here, as the base loader does. An alpha of 0 (or none)
means a scaling of 1, as llama.cpp reads it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from pagellm.config.model import ModelConfig
from pagellm.errors import ModelLoadError, UnsupportedModelError

_LORA_TENSOR = re.compile(r"^(blk\.\d+\.[a-z_]+\.weight)\.lora_([ab])$")


def is_gguf_file(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except (OSError, ValueError):
        return False


def read_gguf_adapter(path: Path, config: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """(an adapter_config.json's fields, tensors under PEFT's names) from a GGUF LoRA file.
    Raises ValueError naming the problem (the caller adds the file)."""
    from gguf import GGUFReader

    from pagellm.model.checkpoint.gguf_metadata import dequantize_tensor, gguf_fields
    from pagellm.model.loader.gguf_loader import hf_tensor_name, undo_rope_permutation

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the gguf package's own errors on bad bytes
        raise ValueError(f"not a readable GGUF file ({e})") from None
    fields, _ = gguf_fields(reader)
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ValueError(
            f"a GGUF file of general.type {fields.get('general.type')!r}, adapter.type {fields.get('adapter.type')!r}: "
            "not a LoRA adapter (a model file is served with --model)"
        )
    architecture = str(fields.get("general.architecture", ""))
    tensors: dict[str, torch.Tensor] = {}
    rank = 0
    for tensor in reader.tensors:
        match = _LORA_TENSOR.match(tensor.name)
        if match is None:
            raise ValueError(f"tensor {tensor.name!r} is not a LoRA weight (blk.N.<kind>.weight.lora_a / .lora_b)")
        try:
            hf_name = hf_tensor_name(match.group(1), architecture)
            values = dequantize_tensor(tensor)
        except (ModelLoadError, UnsupportedModelError) as e:
            raise ValueError(str(e)) from None
        module = hf_name.removesuffix(".weight")
        if match.group(2) == "a":
            rank = max(rank, values.shape[0])
        elif architecture == "llama":
            heads = {".q_proj": config.num_attention_heads, ".k_proj": config.num_key_value_heads}.get(module[-7:])
            if heads is not None and values.shape[0] % (2 * heads) == 0:
                values = undo_rope_permutation(values, heads)
        tensors[f"base_model.model.{module}.lora_{match.group(2).upper()}.weight"] = torch.from_numpy(np.ascontiguousarray(values))
    alpha = fields.get("adapter.lora.alpha") or 0
    # llama.cpp: scale = alpha / rank, and 1 without an alpha; each projection's own rank here.
    config_fields = {"peft_type": "LORA", "r": rank}
    if alpha:
        config_fields["lora_alpha"] = float(alpha)
    else:
        config_fields["scaling_one"] = True
    return config_fields, tensors
