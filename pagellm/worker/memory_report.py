"""Worker stage: what one rank holds in memory, by component, in bytes.

The weights (as held: packed quantized blocks, bf16, float32), the KV cache reserved on
the device and the host swap space, a hybrid model's recurrent states (running slots,
prefix-hit snapshots, swapped-out slots) and the prefix cache tier's host cache (its
capacity). Each tensor's storage is counted once, however many layers share it. What is
not a named component (activations, kernel buffers, the interpreter) is what the
process's resident set holds beyond these: metrics/ reports that beside them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def storage_bytes(values: Iterable[Any], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind the tensors in `values` (nested tuples, lists
    and objects with tensor attributes, such as a layer's recurrent state)."""
    seen = set() if seen is None else seen
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(value, (list, tuple)):
            total += storage_bytes(value, seen)
        elif hasattr(value, "__dict__") and not isinstance(value, nn.Module):
            total += storage_bytes(vars(value).values(), seen)
    return total


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """The weights by how they are held: a model that reports them so (packed blocks
    included) says so itself; otherwise its parameters' and buffers' storages, by dtype."""
    by_format = getattr(model, "weight_bytes_by_format", None)
    if callable(by_format):
        return by_format()
    totals: dict[str, int] = {}
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        key = str(tensor.dtype).removeprefix("torch.")
        totals[key] = totals.get(key, 0) + storage_bytes([tensor], seen)
    return totals


def weight_bytes(model: nn.Module) -> int:
    """The weights as held, in bytes (weight_bytes_by_format's total)."""
    return sum(weight_bytes_by_format(model).values())


def memory_by_component(runner: Any) -> dict[str, int]:
    """The named components of a model runner (worker/model_runner.py), in bytes."""
    tier = runner.kv_tier
    host_cache = tier.host.capacity_bytes if tier is not None and tier.host is not None else 0
    return {
        "weights": weight_bytes(runner.model),
        "kv_cache": storage_bytes(runner.kv_caches),
        "kv_swap_space": storage_bytes(runner.host_kv_caches),
        "recurrent_state": storage_bytes([runner.linear_states, runner.snapshot_states, runner.host_states]),
        "tier_host_cache": host_cache,
    }
