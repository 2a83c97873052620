"""The kernel choice's measurement stand-ins (model/linear_plans.py): a large layer is timed
on a slice of its output features that keeps every stored part and its bias."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels.weights import PackedWeight, WeightType, kernels_support, quantize_int8_rows
from pagellm.model import linear_plans
from pagellm.model.packable_layers import PackableLinear, apply_linear

pytestmark = pytest.mark.skipif(not kernels_support(WeightType.I8_ROW), reason="the native kernels do not run here")


def _packed_layer(part_rows: list[int], k: int, bias: bool) -> PackableLinear:
    torch.manual_seed(0)
    layer = PackableLinear(k, sum(part_rows), bias=bias)
    if bias:
        layer.bias.data = torch.randn(sum(part_rows))
    weights = torch.randn(sum(part_rows), k).split(part_rows)
    layer.use_packed(PackedWeight([quantize_int8_rows(w) for w in weights], k))
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_a_slice_keeps_each_parts_first_rows_and_their_bias(bias):
    part_rows, k = [64, 32, 32], 64  # a fused q/k/v of three stored parts
    layer = _packed_layer(part_rows, k, bias)
    weight, packed, sliced_bias = linear_plans._timed_slice(layer, 64)
    assert weight is None and [p.rows for p in packed.parts] == [32, 16, 16]
    x = torch.randn(5, k)
    whole = apply_linear(x, None, layer.packed, layer.bias, None, None, torch.float32)
    part = apply_linear(x, None, packed, sliced_bias, None, None, torch.float32)
    expected = torch.cat([whole[:, 0:32], whole[:, 64:80], whole[:, 96:112]], dim=1)
    torch.testing.assert_close(part, expected)


def test_a_small_layer_is_timed_whole_and_a_large_one_in_part():
    layer = _packed_layer([96], 64, bias=True)
    assert linear_plans._timed_slice(layer, 96)[1] is layer.packed
    dense = PackableLinear(64, 8192, bias=False)
    weight, packed, _ = linear_plans._timed_slice(dense, 4096)
    assert packed is None and weight.shape == (4096, 64) and weight.data_ptr() == dense.weight.data_ptr()
