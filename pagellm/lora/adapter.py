"""Lora stage: a PEFT adapter folder (or a GGUF LoRA file, lora/gguf_adapter.py) read into
the model's fused layout.

PEFT saves, per adapted linear layer, lora_A [r, in_features] and lora_B [out_features, r]
(`adapter_model.safetensors`, keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`), and in
`adapter_config.json` the rank `r`, `lora_alpha`, `use_rslora` and per-layer exceptions
(`rank_pattern`, `alpha_pattern`). A layer's output gains
    ((x A^T) B^T) * scaling,   scaling = alpha / r   (rsLoRA: alpha / sqrt(r)).

pagellm fuses q/k/v into one qkv_proj and gate/up into gate_up_proj, so the adapters of
the separate HF projections are laid side by side: A stacked along the rank (q's rows, then
k's, then v's) and B block-diagonal (q's rows of the output take only q's ranks), with each
rank's scaling kept beside it. One shrink and one expand then serve the fused layer; a
projection the adapter leaves alone has no ranks in it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagellm.config.model import ModelConfig
from pagellm.errors import InvalidRequestError
from pagellm.lora.gguf_adapter import is_gguf_file, read_gguf_adapter

if TYPE_CHECKING:
    from pagellm.model.tensor_parallel import TPLayout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# HF's separate projections -> pagellm's fused layer and the index of its output shard.
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>layers\.\d+\.\w+\.\w+)\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$")


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served: its message names the file and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora_path")


@dataclass(frozen=True)
class LoRATarget:
    """One linear layer an adapter may change: its input width and output shards."""

    in_features: int
    shards: tuple[int, ...]  # output widths of the fused projections, in order

    @property
    def out_features(self) -> int:
        return sum(self.shards)


def lora_targets(config: ModelConfig) -> dict[str, LoRATarget]:
    """The layers of a model LoRA can adapt, by pagellm module name: every layer's attention
    projections and the MLP of the dense layers (an expert's MLP is not a target)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    targets: dict[str, LoRATarget] = {}
    for i in range(config.num_hidden_layers):
        targets[f"layers.{i}.self_attn.qkv_proj"] = LoRATarget(h, (q, kv, kv))
        targets[f"layers.{i}.self_attn.o_proj"] = LoRATarget(q, (h,))
        if not config.is_sparse_layer(i):
            targets[f"layers.{i}.mlp.gate_up_proj"] = LoRATarget(h, (inter, inter))
            targets[f"layers.{i}.mlp.down_proj"] = LoRATarget(inter, (h,))
    return targets


@dataclass
class LayerAdapter:
    """One fused layer's share of an adapter: A [ranks, in], B [out, ranks] (block-diagonal
    over the shards), the scaling of each rank [ranks], and the blocks: per projection
    (first rank, end rank, first output column, end output column)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: torch.Tensor
    pieces: list[tuple[int, int, int, int]]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """An adapter read from its folder: the layers it changes, and its largest per-projection rank."""

    name: str
    path: str
    layers: dict[str, LayerAdapter]
    max_rank: int

    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes for t in self.layers.values())


def _read_config(folder: Path) -> dict:
    config_path = folder / CONFIG_FILE
    try:
        is_folder = folder.is_dir()
    except (OSError, ValueError):  # a name the file system cannot take (a NUL byte, too long)
        is_folder = False
    if not is_folder:
        raise LoRAAdapterError(
            f"LoRA adapter {str(folder)!r} is not a folder (a PEFT adapter is a folder with {CONFIG_FILE}) "
            "nor a GGUF LoRA file"
        )
    if not config_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {str(folder)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{config_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_path}: expected a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAAdapterError(f"{config_path}: peft_type {kind!r} is not LoRA")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)")):
        if config.get(flag):
            raise LoRAAdapterError(f"{config_path}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{config_path}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"{config_path}: modules_to_save {config['modules_to_save']} (fully trained layers) is not supported"
        )
    return config


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first key matching the end of the HF module name."""
    for key, value in (patterns or {}).items():
        # Keys name the module as PEFT sees it, with or without the leading `model.`.
        try:
            matches = any(re.fullmatch(rf"(?:.*\.)?{key}", name) for name in (module, f"model.{module}"))
        except re.error:  # not a pattern: the name's end, literally
            matches = module.endswith(key)
        if matches:
            return value
    return default


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {str(folder)!r} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(f"{path}: not a readable safetensors file ({e})") from None


def load_lora_adapter(
    path: str, name: str, config: ModelConfig, max_lora_rank: int, dtype: torch.dtype = torch.float32,
    tp: TPLayout | None = None,
) -> LoRAAdapter:
    """Read and check a PEFT adapter folder against the model it will run on (the whole
    model's config); with `tp`, this tensor-parallel rank's share: a column-parallel layer's
    B cut to the rank's output rows, a row-parallel one's A to its input columns (the
    products then sum over the ranks with the base layer's partial outputs)."""
    folder = Path(path).expanduser()
    if is_gguf_file(folder):
        source = folder
        try:
            adapter_config, tensors = read_gguf_adapter(folder, config)
        except ValueError as e:
            raise LoRAAdapterError(f"{folder}: {e}") from None
    else:
        source = folder / WEIGHTS_FILE
        adapter_config = _read_config(folder)
        tensors = _read_weights(folder)
    targets = lora_targets(config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is not None:
            pairs.setdefault(match["module"], {})[match["ab"]] = tensor
        elif ".lora_" in key:  # a LoRA layer outside the decoder layers (embedding, LM head)
            module = key.split(".lora_")[0].removeprefix("base_model.model.")
            raise LoRAAdapterError(
                f"{source}: {module} is not a layer LoRA can adapt in this model "
                "(attention q/k/v/o and the dense MLP's gate/up/down are)"
            )
        else:
            others.append(key)
    if others:
        raise LoRAAdapterError(f"{source}: tensor {others[0]!r} is not a LoRA weight of a decoder layer")
    if not pairs:
        raise LoRAAdapterError(f"{source}: no LoRA weights")
    alpha = adapter_config.get("lora_alpha", adapter_config.get("r", 8))
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
    max_rank = 0
    for hf_module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{source}: {hf_module} has lora_{''.join(ab)} without its pair")
        prefix, projection = hf_module.rsplit(".", 1)
        module, shard = _FUSED.get(projection, (projection, None))
        target = targets.get(f"{prefix}.{module}")
        if target is None:
            raise LoRAAdapterError(
                f"{source}: {hf_module} is not a layer LoRA can adapt in this model "
                "(attention q/k/v/o and the dense MLP's gate/up/down are)"
            )
        a, b = ab["A"], ab["B"]
        rank = a.shape[0] if a.dim() == 2 else 0
        if rank == 0:
            raise LoRAAdapterError(f"{source}: {hf_module} has lora_A of shape {tuple(a.shape)}: no rank")
        out = target.out_features if shard is None else target.shards[shard]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or tuple(b.shape) != (out, rank):
            raise LoRAAdapterError(
                f"{source}: {hf_module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this model needs [r, {target.in_features}] and [{out}, r]"
            )
        if rank > max_lora_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: rank {rank} of {hf_module} is above --max-lora-rank {max_lora_rank}"
            )
        max_rank = max(max_rank, rank)
        layer_alpha = _pattern_value(adapter_config.get("alpha_pattern"), hf_module, alpha)
        scaling = layer_alpha / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank)
        if adapter_config.get("scaling_one"):  # a GGUF LoRA without an alpha: llama.cpp scales by 1
            scaling = 1.0
        if tp is not None:
            if shard is None and len(target.shards) > 1:
                raise LoRAAdapterError(f"{source}: {hf_module}: a fused projection's adapter under tensor parallelism")
            weight_name = f"model.{hf_module}.weight"
            rows, columns = tp.out_rows(weight_name), tp.in_columns(weight_name)
            b = b if rows is None else b[rows.start : rows.stop]
            a = a if columns is None else a[:, columns.start : columns.stop]
        pieces.setdefault(f"{prefix}.{module}", []).append((-1 if shard is None else shard, a, b, scaling))
    local = targets if tp is None else lora_targets(tp.local_config(config))
    layers = {module: _fuse(local[module], sorted(parts, key=lambda p: p[0]), dtype) for module, parts in pieces.items()}
    return LoRAAdapter(name, path, layers, max_rank)


def _fuse(target: LoRATarget, parts: list[tuple[int, torch.Tensor, torch.Tensor, float]], dtype: torch.dtype) -> LayerAdapter:
    """The shards' A stacked, B block-diagonal over the shards' output rows."""
    ranks = sum(a.shape[0] for _, a, _, _ in parts)
    a_all = torch.zeros(ranks, target.in_features, dtype=dtype)
    b_all = torch.zeros(target.out_features, ranks, dtype=dtype)
    scaling = torch.empty(ranks, dtype=torch.float32)
    offsets = [0]
    for width in target.shards:
        offsets.append(offsets[-1] + width)
    col = 0
    pieces = []
    for shard, a, b, scale in parts:
        rank = a.shape[0]
        rows = slice(0, target.out_features) if shard < 0 else slice(offsets[shard], offsets[shard + 1])
        a_all[col : col + rank] = a.to(dtype)
        b_all[rows, col : col + rank] = b.to(dtype)
        scaling[col : col + rank] = scale
        pieces.append((col, col + rank, rows.start, rows.stop))
        col += rank
    return LayerAdapter(a_all, b_all, scaling, pieces)
