"""Worker stage: the KV cache tensors, one per layer, addressed by block id."""

from __future__ import annotations

import mmap

import torch

from pagellm.config.model import ModelConfig


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> list[torch.Tensor]:
    """Per layer [2, num_blocks, block_size, num_kv_heads, head_dim], zero-filled.

    Zeros matter: batched attention reads padding slots (masked out) and 0 * NaN from
    uninitialized memory would still poison the result. On CPU the zeros come from an
    anonymous memory map, so untouched blocks cost no RAM (the kernel maps them to its
    shared zero page until they are written).
    """
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    if torch.device(device).type == "cpu" and not pin_memory:
        return [_lazy_zeros(shape, dtype) for _ in range(config.num_hidden_layers)]
    return [
        torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        for _ in range(config.num_hidden_layers)
    ]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    # The tensor keeps a reference to the buffer, so the mapping lives as long as it does.
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
