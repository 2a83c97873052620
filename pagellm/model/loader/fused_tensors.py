"""Model stage: checkpoints that store q/k/v or gate/up as one tensor (Phi-3's `qkv_proj`
and `gate_up_proj`; llama.cpp's `attn_qkv`, and Phi-3's `ffn_up` holding gate and up)
are cut into the separate projections every other family stores, so that one path
(the model's stacking, tensor-parallel sharding, quantized parts) serves them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from pagellm.config.model import ModelConfig

Rows = TypeVar("Rows")  # a torch tensor or a numpy array, cut along its first axis


def fused_pieces(hf_name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """(name, first row, end row) of each projection inside a fused tensor, or None when
    `hf_name` is not a fused one."""
    for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):  # fmt: skip
        marker = f".{fused}."
        if marker not in hf_name:
            continue
        prefix, suffix = hf_name.split(marker)
        module = fused.split(".")[0]
        if parts[0] == "q_proj":
            q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
            sizes = (q, kv, kv)
        else:
            sizes = (config.intermediate_size, config.intermediate_size)
        pieces, start = [], 0
        for part, size in zip(parts, sizes, strict=True):
            pieces.append((f"{prefix}.{module}.{part}.{suffix}", start, start + size))
            start += size
        return pieces
    return None


def split_fused(name: str, rows: Rows, config: ModelConfig) -> Iterator[tuple[str, Rows]]:
    """The tensor itself, or its projections when it is a fused one. A fused tensor whose
    rows do not add up to the config's sizes is left whole (the model names it then)."""
    pieces = fused_pieces(name, config)
    if pieces is None or pieces[-1][2] != rows.shape[0]:  # type: ignore[attr-defined]
        yield name, rows
        return
    for piece, start, end in pieces:
        yield piece, rows[start:end]  # type: ignore[index]
