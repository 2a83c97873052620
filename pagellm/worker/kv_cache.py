"""Worker stage: the KV cache tensors, one per layer (shared across KV cache groups),
addressed by block id."""

from __future__ import annotations

import mmap

import torch

from pagellm.config.kv_layout import kv_cache_layout
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

    The layers' KV cache groups (config/kv_layout.py) share the tensors: there are
    layers_per_block of them, and the i-th layer of every group gets the i-th, so the list
    holds the same tensor several times where a model has several groups.
    Zeros matter: batched attention reads padding slots (masked out) and 0 * NaN from
    uninitialized memory would still poison the result. On CPU the zeros come from an
    anonymous memory map, so untouched blocks cost no RAM (the kernel maps them to its
    shared zero page until they are written).
    """
    layout = kv_cache_layout(config)
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    if torch.device(device).type == "cpu" and not pin_memory:
        tensors = [_lazy_zeros(shape, dtype) for _ in range(layout.layers_per_block)]
    else:
        tensors = [
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
            for _ in range(layout.layers_per_block)
        ]
    # A hybrid's linear-attention layers keep recurrent state instead (worker/recurrent_state.py).
    return [
        NO_KV_CACHE if config.is_linear_attention_layer(layer) else tensors[layout.tensor_of_layer(layer)]
        for layer in range(config.num_hidden_layers)
    ]


# The entry of a layer without K/V (a linear-attention layer): empty, in no copy or count.
NO_KV_CACHE = torch.empty(0)


def distinct_tensors(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each cache tensor once (layers of different groups share them), in order; layers
    without K/V have none."""
    seen: set[int] = set()
    distinct = []
    for tensor in kv_caches:
        if id(tensor) not in seen and tensor.numel():
            seen.add(id(tensor))
            distinct.append(tensor)
    return distinct


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    # The tensor keeps a reference to the buffer, so the mapping lives as long as it does.
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
