"""Worker stage: the KV cache tensors, one per layer, addressed by block id."""

from __future__ import annotations

import torch

from pagellm.model.config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_key_value_heads * config.head_dim * element_size
    return config.num_hidden_layers * block_size * per_token


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> list[torch.Tensor]:
    """Per layer [2, num_blocks, block_size, num_kv_heads, head_dim].

    Left uninitialized: a slot is always written before it is read, and untouched host
    memory costs nothing until a block is actually used.
    """
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        for _ in range(config.num_hidden_layers)
    ]
