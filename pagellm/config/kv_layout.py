"""Config stage: how a model's layers share the paged KV cache (its KV cache groups).

Layers that attend over the whole context and layers that attend over a sliding window
keep their K/V for different lengths of time: a global layer needs every position until
the request ends, a sliding layer only the last `window` ones. So the layers are split
into groups of one kind each, and every group has its own block table per request; the
KV cache manager frees a sliding group's blocks as the window passes them.

All groups draw on one pool of blocks. That works because every group spans the same
cache tensors: the cache is `layers_per_block` tensors of [2, num_blocks, block_size,
tensor_width] (tensor_width elements of K, and of V, per token), and a group's layers
take their columns in order. A block id thus names the same bytes in whatever group
holds it, and a block a sliding group frees can be handed to a global group (or another
request) at once.

Most models have one head shape: a layer's K is tensor_width wide and fills a tensor
(the cache as [2, num_blocks, block_size, kv_heads, head_dim], one layer per tensor).
Gemma 4's global layers have heads of another size and count; there tensor_width is the
widest layer's, and a narrower kind packs several layers side by side into one tensor
(each layer then sees a strided view of its columns). A kind whose layer count does not
fill its last group leaves some of that group's columns unused (the padding
`wasted_share` reports); layers_per_block is chosen to keep that small with few groups. A
model of one kind is one group of all its layers, the cache as it always was.

Layers that share another layer's K/V (Gemma 4's last num_kv_shared_layers) are in no
group of their own: they read their owner's columns, and hold no blocks.
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
    layers: tuple[int, ...]  # the layers that own K/V here, in column order
    num_kv_heads: int = 0
    head_dim: int = 0
    layers_per_tensor: int = 1  # narrower layers side by side in one cache tensor

    @property
    def width(self) -> int:
        """Elements of one token's K (or V) in one of the group's layers."""
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class KVCachePlace:
    """Where a layer's K/V live: which cache tensor, from which column, in what shape."""

    group: int
    tensor: int
    column: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # cache tensors; a block holds block_size tokens of each
    tensor_width: int = 0  # elements of K (and of V) per token in each tensor
    # A KV-shared layer -> the layer whose K/V it reads.
    shared: tuple[tuple[int, int], ...] = ()

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def uniform(self) -> bool:
        """Whether every layer has one head shape (the plain cache: a layer's K fills its tensor)."""
        return len({(group.num_kv_heads, group.head_dim) for group in self.groups}) == 1

    def owner_of(self, layer: int) -> int:
        return dict(self.shared).get(layer, layer)

    def group_of_layer(self, layer: int) -> int:
        owner = self.owner_of(layer)
        for index, group in enumerate(self.groups):
            if owner in group.layers:
                return index
        raise ValueError(f"layer {layer} is in no KV cache group")

    def place_of_layer(self, layer: int) -> KVCachePlace:
        index = self.group_of_layer(layer)
        group = self.groups[index]
        position = group.layers.index(self.owner_of(layer))
        tensor, slot = divmod(position, group.layers_per_tensor)
        return KVCachePlace(index, tensor, slot * group.width, group.num_kv_heads, group.head_dim)

    def tensor_of_layer(self, layer: int) -> int:
        """Which of the layers_per_block cache tensors layer `layer` reads and writes."""
        return self.place_of_layer(layer).tensor

    @property
    def wasted_share(self) -> float:
        """Share of the cache's bytes no layer uses (padding of a kind's last group)."""
        used = sum(len(group.layers) * group.width for group in self.groups)
        return 1 - used / (len(self.groups) * self.layers_per_block * self.tensor_width)

    def describe(self) -> str:
        """E.g. `2 groups of 4 layers: 1 global, 1 window 1024`, for the startup log."""
        kinds: dict[int | None, int] = {}
        for group in self.groups:
            kinds[group.window] = kinds.get(group.window, 0) + 1
        parts = [f"{count} {'global' if window is None else f'window {window}'}" for window, count in kinds.items()]
        layers = f"{self.layers_per_block} layer{'s' if self.layers_per_block > 1 else ''}"
        if not self.uniform:
            layers = f"{self.layers_per_block} tensor{'s' if self.layers_per_block > 1 else ''} of {self.tensor_width} per token"
        text = f"{len(self.groups)} group{'s' if len(self.groups) > 1 else ''} of {layers}: "
        waste = f" ({self.wasted_share:.0%} padding)" if self.wasted_share else ""
        shared = f"; {len(self.shared)} layers reuse others' K/V (no blocks)" if self.shared else ""
        return text + ", ".join(parts) + waste + shared


def kv_cache_layout(config: ModelConfig) -> KVCacheLayout:
    """The groups of `config`'s layers: one per kind when every layer is alike, else as
    many groups of layers_per_block tensors as the kinds need, layers_per_block chosen for
    the least padding in the global groups, then in all, among layouts of at most
    MAX_KV_CACHE_GROUPS groups (ties: fewer groups). A kind is a window and a head shape."""
    layers_by_kind: dict[tuple[int | None, int, int], list[int]] = {}
    # A hybrid's linear-attention layers keep recurrent state, not K/V: in no group; nor
    # do the layers that read another's K/V.
    for layer in config.kv_layers:
        kind = (config.layer_window(layer), config.layer_kv_heads(layer), config.layer_head_dim(layer))
        layers_by_kind.setdefault(kind, []).append(layer)
    shared = tuple((layer, config.kv_owner(layer)) for layer in config.attention_layers if config.kv_owner(layer) != layer)
    # Global layers first, then windows in ascending order: a stable, readable order.
    kinds = sorted(layers_by_kind.items(), key=lambda item: (-1 if item[0][0] is None else item[0][0], item[0][1:]))
    tensor_width = max(heads * dim for (_, heads, dim), _ in kinds)
    per_tensor = [tensor_width // (heads * dim) for (_, heads, dim), _ in kinds]
    if len(kinds) == 1:
        (window, heads, dim), layers = kinds[0]
        group = KVCacheGroup(window, tuple(layers), heads, dim)
        return KVCacheLayout((group,), len(layers), tensor_width, shared)
    if len(kinds) > MAX_KV_CACHE_GROUPS:
        raise UnsupportedModelError(f"{len(kinds)} different attention kinds: at most {MAX_KV_CACHE_GROUPS} are supported")
    counts = [len(layers) for _, layers in kinds]

    def num_groups(size: int) -> int:
        return sum(cdiv(count, size * each) for count, each in zip(counts, per_tensor, strict=True))

    def padding(size: int, global_only: bool) -> int:
        """Unused elements per token of context in the groups (the global kinds' alone)."""
        unused = 0
        for ((window, heads, dim), layers), each in zip(kinds, per_tensor, strict=True):
            if not (global_only and window is not None):
                unused += cdiv(len(layers), size * each) * size * tensor_width - len(layers) * heads * dim
        return unused

    feasible = [size for size in range(1, max(counts) + 1) if num_groups(size) <= MAX_KV_CACHE_GROUPS]
    # A global group's blocks live as long as its request, a sliding group's only for the
    # window: padding in a global group costs in proportion to the context, so it goes first.
    size = min(feasible, key=lambda s: (padding(s, True), padding(s, False), num_groups(s)))
    groups = tuple(
        KVCacheGroup(window, tuple(layers[start : start + size * each]), heads, dim, each)
        for ((window, heads, dim), layers), each in zip(kinds, per_tensor, strict=True)
        for start in range(0, len(layers), size * each)
    )
    return KVCacheLayout(groups, size, tensor_width, shared)


def kv_bytes_per_token(config: ModelConfig, element_bytes: float) -> tuple[float, float]:
    """Bytes of K and V one token holds in the global layers and in the sliding layers (the
    layers that own K/V, without padding: what a request's context really takes)."""
    global_bytes = sliding_bytes = 0.0
    for layer in config.kv_layers:
        size = 2 * config.layer_kv_width(layer) * element_bytes
        if config.layer_window(layer) is None:
            global_bytes += size
        else:
            sliding_bytes += size
    return global_bytes, sliding_bytes


__all__ = ["KVCacheGroup", "KVCacheLayout", "KVCachePlace", "MAX_KV_CACHE_GROUPS", "kv_bytes_per_token", "kv_cache_layout"]
