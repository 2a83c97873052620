"""Config stage: how a model's layers share the paged KV cache (its KV cache groups).

Layers that attend over the whole context and layers that attend over a sliding window
keep their K/V for different lengths of time: a global layer needs every position until
the request ends, a sliding layer only the last `window` ones. So the layers are split
into groups of one kind each, and every group has its own block table per request; the
KV cache manager frees a sliding group's blocks as the window passes them.

All groups draw on one pool of blocks. That works because every group has the same
number of layers, `layers_per_block`: the cache is `layers_per_block` tensors of
[2, num_blocks, block_size, kv_heads, head_dim], and the i-th layer of each group uses
tensor i. A block id thus names the same bytes in whatever group holds it, and a block
a sliding group frees can be handed to a global group (or another request) at once.
A kind whose layer count is not a multiple of layers_per_block leaves some of its last
group's tensors unused (the padding `wasted_share` reports); layers_per_block is chosen to
keep that small with few groups. A model of one kind is one group of all its layers,
the cache as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.config.model import ModelConfig
from pagellm.config.units import cdiv
from pagellm.errors import UnsupportedModelError

# More groups cost more per step (a block table each); fewer may waste cache on padding.
MAX_KV_CACHE_GROUPS = 8


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # the layers' sliding window; None: global attention
    layers: tuple[int, ...]  # at most layers_per_block; the i-th uses cache tensor i


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # cache tensors; a block holds block_size tokens of this many layers

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    def group_of_layer(self, layer: int) -> int:
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index
        raise ValueError(f"layer {layer} is in no KV cache group")

    def tensor_of_layer(self, layer: int) -> int:
        """Which of the layers_per_block cache tensors layer `layer` reads and writes."""
        return self.groups[self.group_of_layer(layer)].layers.index(layer)

    @property
    def wasted_share(self) -> float:
        """Share of the cache's bytes no layer uses (padding of a kind's last group)."""
        used = sum(len(group.layers) for group in self.groups)
        return 1 - used / (len(self.groups) * self.layers_per_block)

    def describe(self) -> str:
        """E.g. `2 groups of 4 layers: 1 global, 1 window 1024`, for the startup log."""
        kinds: dict[int | None, int] = {}
        for group in self.groups:
            kinds[group.window] = kinds.get(group.window, 0) + 1
        parts = [f"{count} {'global' if window is None else f'window {window}'}" for window, count in kinds.items()]
        layers = f"{self.layers_per_block} layer{'s' if self.layers_per_block > 1 else ''}"
        text = f"{len(self.groups)} group{'s' if len(self.groups) > 1 else ''} of {layers}: "
        waste = f" ({self.wasted_share:.0%} padding)" if self.wasted_share else ""
        return text + ", ".join(parts) + waste


def kv_cache_layout(config: ModelConfig) -> KVCacheLayout:
    """The groups of `config`'s layers: one per kind when every layer is alike, else as
    many groups of layers_per_block layers as the kinds need, layers_per_block chosen for
    the least padding among layouts of at most MAX_KV_CACHE_GROUPS groups (ties: fewer
    groups)."""
    layers_by_window: dict[int | None, list[int]] = {}
    # A hybrid's linear-attention layers keep recurrent state, not K/V: in no group.
    for layer in config.attention_layers:
        layers_by_window.setdefault(config.layer_window(layer), []).append(layer)
    # Global layers first, then windows in ascending order: a stable, readable order.
    kinds = sorted(layers_by_window.items(), key=lambda item: -1 if item[0] is None else item[0])
    if len(kinds) == 1:
        window, layers = kinds[0]
        return KVCacheLayout((KVCacheGroup(window, tuple(layers)),), len(layers))
    if len(kinds) > MAX_KV_CACHE_GROUPS:
        raise UnsupportedModelError(f"{len(kinds)} different attention windows: at most {MAX_KV_CACHE_GROUPS} are supported")
    counts = [len(layers) for _, layers in kinds]

    def num_groups(size: int) -> int:
        return sum(cdiv(count, size) for count in counts)

    feasible = [size for size in range(1, max(counts) + 1) if num_groups(size) <= MAX_KV_CACHE_GROUPS]
    size = min(feasible, key=lambda s: (num_groups(s) * s, num_groups(s)))
    groups = tuple(
        KVCacheGroup(window, tuple(layers[start : start + size]))
        for window, layers in kinds
        for start in range(0, len(layers), size)
    )
    return KVCacheLayout(groups, size)


__all__ = ["KVCacheGroup", "KVCacheLayout", "MAX_KV_CACHE_GROUPS", "kv_cache_layout"]
