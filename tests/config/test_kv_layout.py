"""config/kv_layout.py: which layers share the paged cache's tensors, and where each one's
K/V lives (groups, tensors, columns), for one head shape, several, and KV-shared layers."""

from __future__ import annotations

import dataclasses

import pytest

from pagellm.config.kv_layout import MAX_KV_CACHE_GROUPS, kv_bytes_per_token, kv_cache_layout
from pagellm.config.model import ModelConfig
from pagellm.sim.model_presets import get_model_preset


def _config(**fields: object) -> ModelConfig:
    shape = dict(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    )  # fmt: skip
    return ModelConfig(**{**shape, **fields})  # type: ignore[arg-type]


def _places(config: ModelConfig) -> dict[int, tuple[int, int, int]]:
    layout = kv_cache_layout(config)
    return {layer: dataclasses.astuple(layout.place_of_layer(layer))[:3] for layer in config.attention_layers}


def test_one_head_shape_and_one_kind_is_one_group_of_every_layer():
    layout = kv_cache_layout(_config())
    assert len(layout.groups) == 1 and layout.layers_per_block == 6 and layout.uniform
    assert layout.tensor_width == 2 * 16 and layout.wasted_share == 0
    assert [layout.tensor_of_layer(layer) for layer in range(6)] == list(range(6))


def test_sliding_and_global_layers_take_the_same_tensors_in_their_own_groups():
    config = _config(sliding_window=8, sliding_window_layers=(0, 1, 3, 4))
    layout = kv_cache_layout(config)
    assert layout.windows == (None, 8, 8) and layout.layers_per_block == 2 and layout.wasted_share == 0
    assert _places(config) == {2: (0, 0, 0), 5: (0, 1, 0), 0: (1, 0, 0), 1: (1, 1, 0), 3: (2, 0, 0), 4: (2, 1, 0)}


def test_narrower_layers_sit_side_by_side_in_one_tensor():
    """Global heads 2 x 32 (64 wide), sliding 2 x 16 (32 wide): two sliding layers per tensor."""
    config = _config(sliding_window=8, sliding_window_layers=(0, 1, 3, 4), global_head_dim=32)
    layout = kv_cache_layout(config)
    assert layout.tensor_width == 64 and not layout.uniform
    assert layout.layers_per_block == 2 and layout.wasted_share == 0
    assert [(g.window, g.layers, g.layers_per_tensor) for g in layout.groups] == [(None, (2, 5), 1), (8, (0, 1, 3, 4), 2)]
    # (group, tensor, column): sliding layers 0 and 1 share tensor 0, 3 and 4 tensor 1.
    assert _places(config) == {2: (0, 0, 0), 5: (0, 1, 0), 0: (1, 0, 0), 1: (1, 0, 32), 3: (1, 1, 0), 4: (1, 1, 32)}


def test_kv_shared_layers_are_in_no_group_and_read_their_owners_place():
    config = _config(sliding_window=8, sliding_window_layers=(0, 1, 3, 4), num_kv_shared_layers=2)
    layout = kv_cache_layout(config)
    assert dict(layout.shared) == {4: 3, 5: 2}
    assert sorted(layer for group in layout.groups for layer in group.layers) == [0, 1, 2, 3]
    assert layout.place_of_layer(4) == layout.place_of_layer(3) and layout.place_of_layer(5) == layout.place_of_layer(2)
    global_bytes, sliding_bytes = kv_bytes_per_token(config, 2)
    assert (global_bytes, sliding_bytes) == (1 * 2 * 32 * 2, 3 * 2 * 32 * 2)


def test_a_shared_layer_needs_an_earlier_owner_of_its_kind():
    from pagellm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="no earlier layer of its kind"):
        _config(sliding_window=8, sliding_window_layers=(0, 1, 2, 3, 4), num_kv_shared_layers=1)


def test_global_padding_is_avoided_first():
    """A global group's blocks live as long as the request, a sliding group's only for its
    window: where a layout must pad, it pads the sliding groups (E4B's attention without
    sharing: 7 global layers 1024 wide, 35 sliding 512 wide)."""
    config = dataclasses.replace(get_model_preset("Gemma-4-E4B").config, num_kv_shared_layers=0)
    layout = kv_cache_layout(config)
    assert len(layout.groups) <= MAX_KV_CACHE_GROUPS
    global_groups = [g for g in layout.groups if g.window is None]
    assert sum(len(g.layers) for g in global_groups) == 7
    assert len(global_groups) * layout.layers_per_block == 7  # no unused global tensor


@pytest.mark.parametrize("name", ["Gemma-4-E4B", "Gemma-4-31B", "Gemma-4-26B-A4B", "gpt-oss-20b", "Gemma-3-27B"])
def test_presets_lay_out_every_layer_that_keeps_kv_once(name):
    config = get_model_preset(name).config
    layout = kv_cache_layout(config)
    held = sorted(layer for group in layout.groups for layer in group.layers)
    assert held == list(config.kv_layers)
    assert len(layout.groups) <= MAX_KV_CACHE_GROUPS
    for group in layout.groups:  # a group fits its tensors
        assert len(group.layers) <= layout.layers_per_block * group.layers_per_tensor
        assert group.width * group.layers_per_tensor <= layout.tensor_width
