"""Model stage: gpt-oss's MXFP4 experts as an HF folder stores them, in the layout the kernels hold.

OpenAI's checkpoints keep each sparse layer's experts as two tensors per projection:
`mlp.experts.gate_up_proj_blocks` [experts, rows, groups, 16] (uint8: byte j of a group
holds its elements 2j in the low nibble and 2j + 1 in the high one) and `..._scales`
[experts, rows, groups] (the groups' E8M0 exponents). Rows are output features (not
transposed, unlike the float layout), gate and up interleaved row by row. Each expert's
projections come out as llama.cpp's MXFP4 blocks (an exponent byte, then byte j holding
elements j and j + 16), kept as stored where the kernels run them, else dequantized to
float32: the same bytes, the same values, whichever file they came from.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from pagellm.errors import ModelLoadError
from pagellm.kernels.weights import WeightPart, WeightType, pack_rows
from pagellm.model.tensor_parallel import TPLayout, shard_blocks

_PACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
_GROUP = 32
_BLOCK_BYTES = 17


def mxfp4_experts(
    weights: Iterator[tuple[str, torch.Tensor]], keep: bool, shard: TPLayout | None = None
) -> Iterator[tuple[str, torch.Tensor | WeightPart]]:
    """The weights with every MXFP4 pair (`*_blocks`, `*_scales`) replaced by each expert's
    projections (`mlp.experts.E.gate_proj.weight`, ...): `WeightPart`s with `keep` (this
    rank's share with `shard`), else float32 tensors (sharded later, as the others are)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _PACKED.search(name)
        if match is None:
            yield name, tensor
            continue
        key = name[: match.start()] + f".mlp.experts.{match.group(1)}"
        pair = pending.setdefault(key, {})
        pair[match.group(2)] = tensor
        if len(pair) == 2:
            del pending[key]
            yield from _expert_projections(key, pair["blocks"], pair["scales"], keep, shard)
    if pending:
        key, pair = next(iter(pending.items()))
        missing = "scales" if "blocks" in pair else "blocks"
        raise ModelLoadError(f"checkpoint has {key}_{'blocks' if missing == 'scales' else 'scales'} but no {key}_{missing}")


# Twice each E2M1 code's value (bit 3 the sign): the format's 0, 0.5, 1, 1.5, 2, 3, 4, 6, doubled.
_DOUBLED_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def dequantize_mxfp4(stored: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of llama.cpp's MXFP4 blocks (uint8 [rows, k / 32 * 17], on any device) as `dtype`
    [rows, k], in torch ops on the blocks' device (a GPU model's experts are dequantized so,
    to bf16): exact, every value being a small integer times a power of two."""
    rows = stored.shape[0]
    blocks = stored.reshape(rows, k // _GROUP, _BLOCK_BYTES)
    exponents = blocks[..., 0].to(torch.int32)
    codes = torch.cat([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], dim=-1).long()  # [rows, groups, 32]
    table = torch.tensor(_DOUBLED_E2M1, dtype=torch.float32, device=stored.device)
    values = torch.ldexp(table[codes], (exponents - 128).unsqueeze(-1).to(torch.float32))
    return values.reshape(rows, k).to(dtype)


def gguf_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:  # uint8 [..., groups * 17]
    """HF's MXFP4 ([..., groups, 16] nibble pairs, [..., groups] exponents) as llama.cpp's
    blocks, a row's groups one after another."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelLoadError(f"MXFP4 blocks of shape {blocks.shape} do not match scales of shape {scales.shape}")
    codes = np.empty((*blocks.shape[:-1], _GROUP), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # element j low, element j + 16 high
    stored = np.concatenate([scales[..., None], nibbles], axis=-1)
    return stored.reshape(*blocks.shape[:-2], -1)


def _expert_projections(
    key: str, blocks: torch.Tensor, scales: torch.Tensor, keep: bool, shard: TPLayout | None
) -> Iterator[tuple[str, torch.Tensor | WeightPart]]:
    if blocks.dim() != 4 or scales.dim() != 3:
        raise ModelLoadError(f"{key}: MXFP4 blocks must be [experts, rows, groups, 16], got {tuple(blocks.shape)}")
    stored = gguf_blocks(blocks.numpy(), scales.numpy())  # [experts, rows, groups * 17]
    k = blocks.shape[2] * _GROUP
    prefix, projection = key.rsplit(".mlp.experts.", 1)
    for expert in range(stored.shape[0]):
        rows = stored[expert]
        pieces = {"down_proj": rows} if projection == "down_proj" else {"gate_proj": rows[0::2], "up_proj": rows[1::2]}
        for kind, piece in pieces.items():
            name = f"{prefix}.mlp.experts.{expert}.{kind}.weight"
            if not keep:
                yield name, dequantize_mxfp4(torch.from_numpy(np.ascontiguousarray(piece)), k)
                continue
            data = np.ascontiguousarray(piece)
            if shard is not None:
                data = shard_blocks(shard, name, data, _GROUP, _BLOCK_BYTES)
                if data is None:
                    raise ModelLoadError(f"{name}: its tensor-parallel split cuts MXFP4 blocks")
            yield name, WeightPart(WeightType.MXFP4, torch.from_numpy(np.ascontiguousarray(pack_rows(WeightType.MXFP4, data, k))))
