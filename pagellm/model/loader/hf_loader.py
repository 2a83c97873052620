"""Model stage: read the weights of an HF checkpoint folder (safetensors)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagellm.errors import ModelLoadError
from pagellm.model.checkpoint.hf_config import read_json


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {folder} (only safetensors checkpoints are supported)"
        )
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"weight shard {path} listed in the index is missing")
    return files


def iter_hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors shard."""
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights from {path}: {e}") from None
