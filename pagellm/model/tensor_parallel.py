"""Model stage: Megatron-style tensor parallelism of the Llama family, one rank's share.

Which splits work and the shapes each rank holds are config/parallel.py's rule; this
module slices the weights by it.

Each of the `size` ranks holds:

- a slice of the attention heads (q rows of qkv_proj, the matching columns of o_proj)
  and of the KV heads; where there are fewer KV heads than ranks, each KV head is
  replicated on size / num_kv_heads ranks (every rank needs the K/V of its q heads);
- a slice of the MLP's intermediate dimension (rows of gate_up_proj, columns of
  down_proj);
- a slice of the vocabulary (rows of the embedding and of the LM head), padded so that
  every rank holds the same number of rows;
- full copies of the norms;
- in a hybrid's linear-attention layers (Qwen3.5), a slice of the key heads and of the
  value heads that read them: their rows of the q, k and v parts of in_proj_qkv and of the
  convolution, of in_proj_z, in_proj_b, in_proj_a, A_log and dt_bias, and the matching
  columns of out_proj (row-parallel); each rank keeps the recurrent state of its heads.
  In llama.cpp's tiled value-head order (value head i reads key head i % key heads) a
  rank's value heads are a strided set: each split is then several pieces of rows.

qkv and gate_up are column-parallel (no communication), o_proj and down_proj are
row-parallel (their partial sums are all-reduced), the embedding is all-reduced (each
token's row lives on one rank, the others contribute zeros) and the LM head's logits are
gathered. The model stays in the HF names, so checkpoints are sliced as they load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from pagellm.config.model import ModelConfig
from pagellm.config.parallel import check_tp_size, kv_heads_per_rank, rank_model_config


@dataclass(frozen=True)
class TPLayout:
    """What rank `rank` of `size` holds, in units of the full model."""

    rank: int
    size: int
    num_heads: int  # q heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    first_kv_head: int
    intermediate_size: int  # on this rank
    expert_intermediate_size: int  # each expert's, on this rank (experts are split like dense MLPs)
    shared_expert_intermediate_size: int  # the shared expert's (Qwen2-MoE), on this rank
    vocab_size: int  # the full vocabulary (logits are trimmed to it)
    vocab_per_rank: int  # rows of the padded vocabulary on each rank
    head_dim: int
    q_rows_per_head: int = 0  # head_dim, twice that where q_proj holds the output gate too
    # Linear attention (0: none): the full model's key / value heads, this rank's share of
    # each, their dims, and whether value heads tile over key heads (llama.cpp's order).
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_heads_per_rank: int = 0
    linear_value_heads_per_rank: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_value_heads_tiled: bool = False
    # Gemma 4: its global layers' heads (their size, this rank's KV heads and the first),
    # and the layers whose MLP is twice intermediate_size wide.
    global_layers: frozenset[int] = frozenset()
    global_head_dim: int = 0
    num_global_kv_heads: int = 0
    first_global_kv_head: int = 0
    double_wide_layers: frozenset[int] = frozenset()

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> TPLayout:
        check_tp_size(config, size)
        share = rank_model_config(config, size)
        return cls(
            rank=rank,
            size=size,
            num_heads=share.num_attention_heads,
            num_kv_heads=share.num_key_value_heads,
            first_kv_head=_first_kv_head(config.num_key_value_heads, rank, size),
            intermediate_size=share.intermediate_size,
            expert_intermediate_size=share.expert_intermediate_size,
            shared_expert_intermediate_size=share.shared_expert_intermediate_size,
            vocab_size=config.vocab_size,
            vocab_per_rank=share.vocab_size,
            head_dim=config.head_dim,
            q_rows_per_head=config.head_dim * (2 if config.attention_output_gate else 1),
            **_linear_fields(config, size),
            **_gemma4_fields(config, rank, size),
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank's layers are built with (and its KV cache sized by)."""
        return rank_model_config(config, self.size)

    # ------------------------------------------------------------- slicing

    def out_rows(self, hf_name: str) -> range | None:
        """Rows (output features) of a column-parallel tensor this rank keeps."""
        hd, kv_heads, first_kv, q_rows = self.head_dim, self.num_kv_heads, self.first_kv_head, self.q_rows_per_head
        if self._is_global(hf_name):
            hd, kv_heads, first_kv, q_rows = self.global_head_dim, self.num_global_kv_heads, self.first_global_kv_head, self.global_head_dim
        kind = _kind(hf_name)
        if kind == "q_proj":
            width = self.num_heads * q_rows
            return range(self.rank * width, (self.rank + 1) * width)
        if kind in ("k_proj", "v_proj"):
            return range(first_kv * hd, (first_kv + kv_heads) * hd)
        if kind in ("gate_proj", "up_proj"):
            size = self._mlp_width(hf_name)
            return range(self.rank * size, (self.rank + 1) * size)
        if kind in ("embed_tokens", "lm_head"):
            return range(self.vocab_start, self.vocab_start + self.vocab_per_rank)
        if hf_name.endswith(".self_attn.sinks"):  # one per q head
            return range(self.rank * self.num_heads, (self.rank + 1) * self.num_heads)
        return None

    def in_columns(self, hf_name: str) -> range | None:
        """Columns (input features) of a row-parallel weight this rank keeps."""
        kind = _kind(hf_name)
        if kind == "o_proj" and hf_name.endswith(".weight"):
            width = self.num_heads * (self.global_head_dim if self._is_global(hf_name) else self.head_dim)
            return range(self.rank * width, (self.rank + 1) * width)
        if kind == "down_proj" and hf_name.endswith(".weight"):
            size = self._mlp_width(hf_name)
            return range(self.rank * size, (self.rank + 1) * size)
        return None

    def out_pieces(self, hf_name: str) -> list[range] | None:
        """Rows this rank keeps of a column-parallel tensor, as pieces in order (None: all)."""
        kind = _linear_kind(hf_name)
        if kind is None:
            rows = self.out_rows(hf_name)
            return None if rows is None else [rows]
        if kind in ("in_proj_qkv", "conv1d"):  # q, k, v channels side by side
            key_width = self.linear_key_heads * self.linear_key_dim
            keys = self._key_heads(self.linear_key_dim)
            return [keys, range(key_width + keys.start, key_width + keys.stop), *self._value_heads(self.linear_value_dim, 2 * key_width)]
        if kind == "in_proj_z":
            return self._value_heads(self.linear_value_dim)
        if kind in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
            return self._value_heads(1)
        return None  # out_proj: row-parallel

    def in_pieces(self, hf_name: str) -> list[range] | None:
        """Columns this rank keeps of a row-parallel weight, as pieces in order (None: all)."""
        if _linear_kind(hf_name) == "out_proj":
            return self._value_heads(self.linear_value_dim)
        columns = self.in_columns(hf_name)
        return None if columns is None else [columns]

    def _key_heads(self, width: int) -> range:
        start = self.rank * self.linear_key_heads_per_rank
        return range(start * width, (start + self.linear_key_heads_per_rank) * width)

    def _value_heads(self, width: int, offset: int = 0) -> list[range]:
        """This rank's value heads' `width` rows each (after `offset`): in HF's grouped order
        a run; tiled, one run per value head that each key head has."""
        per_rank = self.linear_value_heads_per_rank
        if not self.linear_value_heads_tiled:
            start = offset + self.rank * per_rank * width
            return [range(start, start + per_rank * width)]
        keys = self.linear_key_heads_per_rank
        first_key = self.rank * keys
        return [
            range(offset + (group * self.linear_key_heads + first_key) * width, offset + (group * self.linear_key_heads + first_key + keys) * width)
            for group in range(self.linear_value_heads // self.linear_key_heads)
        ]

    def _mlp_width(self, hf_name: str) -> int:
        if ".shared_expert." in hf_name:
            return self.shared_expert_intermediate_size
        if ".experts." in hf_name:
            return self.expert_intermediate_size
        return self.intermediate_size * (2 if _layer_of(hf_name) in self.double_wide_layers else 1)

    def _is_global(self, hf_name: str) -> bool:
        """Whether the tensor is a Gemma 4 global layer's (heads of their own shape)."""
        return bool(self.global_layers) and _layer_of(hf_name) in self.global_layers

    def drops_bias(self, hf_name: str) -> bool:
        """A row-parallel layer's bias is added once: by rank 0, after the all-reduce sums."""
        return self.rank != 0 and _kind(hf_name) in ("o_proj", "down_proj") and hf_name.endswith(".bias")


_KIND = re.compile(r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|embed_tokens|lm_head)\.(weight|bias)$")


def _kind(hf_name: str) -> str | None:
    match = _KIND.search(hf_name)
    return match.group(1) if match else None


_LINEAR_KIND = re.compile(r"\.linear_attn\.(?:(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d|out_proj)\.weight|(A_log|dt_bias))$")


def _linear_kind(hf_name: str) -> str | None:
    """Which part of a linear-attention layer a tensor is (None: not one)."""
    match = _LINEAR_KIND.search(hf_name)
    return None if match is None else match.group(1) or match.group(2)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(hf_name: str) -> int | None:
    match = _LAYER.search(hf_name)
    return None if match is None else int(match.group(1))


def _first_kv_head(num_kv_heads: int, rank: int, size: int) -> int:
    """The first of rank `rank`'s KV heads: its share's, or where there are fewer heads than
    ranks the one it replicates (each on size // num_kv_heads ranks)."""
    if num_kv_heads % size == 0:
        return rank * kv_heads_per_rank(num_kv_heads, size)
    return rank // (size // num_kv_heads)


def _gemma4_fields(config: ModelConfig, rank: int, size: int) -> dict[str, object]:
    fields: dict[str, object] = {}
    if config.global_head_dim is not None or config.num_global_key_value_heads is not None:
        global_layers = [layer for layer in config.attention_layers if config.is_global_layer(layer)]
        kv = config.layer_kv_heads(global_layers[0])
        fields.update(
            global_layers=frozenset(global_layers), global_head_dim=config.layer_head_dim(global_layers[0]),
            num_global_kv_heads=kv_heads_per_rank(kv, size), first_global_kv_head=_first_kv_head(kv, rank, size),
        )  # fmt: skip
    if config.double_wide_shared_mlp:
        fields["double_wide_layers"] = frozenset(
            layer for layer in range(config.num_hidden_layers) if config.mlp_intermediate_size(layer) != config.intermediate_size
        )
    return fields


def _linear_fields(config: ModelConfig, size: int) -> dict[str, object]:
    spec = config.linear_attention
    if spec is None:
        return {}
    return {
        "linear_key_heads": spec.num_key_heads,
        "linear_value_heads": spec.num_value_heads,
        "linear_key_heads_per_rank": spec.num_key_heads // size,
        "linear_value_heads_per_rank": spec.num_value_heads // size,
        "linear_key_dim": spec.key_head_dim,
        "linear_value_dim": spec.value_head_dim,
        "linear_value_heads_tiled": spec.value_heads_tiled,
    }


Array = TypeVar("Array", torch.Tensor, np.ndarray)


def shard_rows(layout: TPLayout, hf_name: str, rows: Array) -> Array:
    """The rank's rows of a tensor (all of it where the tensor is not column-parallel);
    rows past the end (the padded vocabulary) are zeros."""
    pieces = layout.out_pieces(hf_name)
    if pieces is None:
        return rows
    if len(pieces) > 1:
        parts = [rows[piece.start : piece.stop] for piece in pieces]
        return torch.cat(parts) if isinstance(rows, torch.Tensor) else np.concatenate(parts)  # type: ignore[return-value]
    [keep] = pieces
    part = rows[keep.start : min(keep.stop, rows.shape[0])]
    missing = keep.stop - max(keep.start, min(keep.stop, rows.shape[0]))
    if missing > 0:
        if isinstance(part, torch.Tensor):
            pad = torch.zeros((missing, *part.shape[1:]), dtype=part.dtype)
            part = torch.cat([part, pad])
        else:
            part = np.concatenate([part, np.zeros((missing, *part.shape[1:]), part.dtype)])
    return part


def shard_float(layout: TPLayout, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The rank's share of a float tensor named as in HF checkpoints."""
    if layout.drops_bias(hf_name):
        return torch.zeros_like(tensor)
    tensor = shard_rows(layout, hf_name, tensor)
    pieces = layout.in_pieces(hf_name)
    if pieces is not None:
        tensor = torch.cat([tensor[:, piece.start : piece.stop] for piece in pieces], dim=1)
    return tensor.contiguous()


def shard_blocks(
    layout: TPLayout, hf_name: str, blocks: np.ndarray, block_elements: int, block_bytes: int
) -> np.ndarray | None:
    """The rank's share of quantized rows (uint8 [rows, bytes of blocks] as a GGUF stores
    them), or None where a column split would cut a quantization block."""
    blocks = shard_rows(layout, hf_name, blocks)
    pieces = layout.in_pieces(hf_name)
    if pieces is None:
        return blocks
    if any(piece.start % block_elements or piece.stop % block_elements for piece in pieces):
        return None
    parts = [blocks[:, piece.start // block_elements * block_bytes : piece.stop // block_elements * block_bytes] for piece in pieces]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


class TPGroup(Protocol):
    """The collectives a tensor-parallel model calls (torch.distributed in practice)."""

    layout: TPLayout

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor: ...


def vocab_parallel_embed(
    layout: TPLayout, embed: torch.nn.Module, input_ids: torch.Tensor
) -> torch.Tensor:  # [num_tokens, hidden_size], this rank's rows only (others zero)
    local = input_ids - layout.vocab_start
    outside = (local < 0) | (local >= layout.vocab_per_rank)
    rows = embed(local.masked_fill(outside, 0))
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)
