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
    holds the same tensor several times where a model has several groups. Where head
    shapes differ (Gemma 4) a tensor is [2, num_blocks, block_size, tensor_width] and each
    layer gets a view of its columns (strided where narrower layers sit side by side); a
    layer that reads another's K/V gets its owner's view.
    Zeros matter: batched attention reads padding slots (masked out) and 0 * NaN from
    uninitialized memory would still poison the result. On CPU the zeros come from an
    anonymous memory map, so untouched blocks cost no RAM (the kernel maps them to its
    shared zero page until they are written).
    """
    layout = kv_cache_layout(config)
    if layout.uniform:
        group = layout.groups[0]
        shape: tuple[int, ...] = (2, num_blocks, block_size, group.num_kv_heads, group.head_dim)
    else:
        shape = (2, num_blocks, block_size, layout.tensor_width)
    if torch.device(device).type == "cpu" and not pin_memory:
        tensors = [_lazy_zeros(shape, dtype) for _ in range(layout.layers_per_block)]
    else:
        tensors = [
            torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
            for _ in range(layout.layers_per_block)
        ]
    caches = []
    for layer in range(config.num_hidden_layers):
        if config.is_linear_attention_layer(layer):  # recurrent state instead (worker/recurrent_state.py)
            caches.append(NO_KV_CACHE)
            continue
        place = layout.place_of_layer(layer)
        tensor = tensors[place.tensor]
        if not layout.uniform:  # the layer's columns
            columns = tensor[..., place.column : place.column + place.num_kv_heads * place.head_dim]
            tensor = columns.unflatten(-1, (place.num_kv_heads, place.head_dim))
        caches.append(tensor)
    return caches


# The entry of a layer without K/V (a linear-attention layer): empty, in no copy or count.
NO_KV_CACHE = torch.empty(0)


def distinct_tensors(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each cache tensor once (layers of different groups share them), in order, whole
    (a layer's view of some columns as its tensor's every column); layers without K/V
    have none."""
    seen: set[int] = set()
    distinct = []
    for tensor in kv_caches:
        if not tensor.numel():
            continue
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            distinct.append(_whole_tensor(tensor))
    return distinct


def _whole_tensor(view: torch.Tensor) -> torch.Tensor:
    """The cache tensor a layer's view lies in: [2, num_blocks, block_size, tensor_width]
    (a plain layer's cache, which fills its tensor, as it is)."""
    if view.is_contiguous() and view.storage_offset() == 0:
        return view
    _, num_blocks, block_size = view.shape[:3]
    width = view.stride(2)  # a token's row spans the whole tensor width
    return view.as_strided((2, num_blocks, block_size, width), (num_blocks * block_size * width, block_size * width, width, 1), 0)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    # The tensor keeps a reference to the buffer, so the mapping lives as long as it does.
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
