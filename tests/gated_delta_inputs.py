"""Test helper: random inputs of a Gated DeltaNet decode step (the arguments of
attention/gated_delta_decode.torch_decode), for the native and the Triton steps' tests."""

from __future__ import annotations

import torch

from pagellm.attention.gated_delta_decode import DecodeShape

NUM_SLOTS = 7


def decode_inputs(shape: DecodeShape, rows: int, kernel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=g) * scale

    slots = torch.randperm(NUM_SLOTS, generator=g)[:rows]
    return [
        randn(rows, shape.conv_dim),  # mixed
        randn(rows, shape.value_heads),  # b
        randn(rows, shape.value_heads, scale=2.0),  # a
        randn(shape.conv_dim, kernel, scale=0.5),  # conv weight
        randn(NUM_SLOTS, shape.conv_dim, kernel - 1),  # conv states
        randn(NUM_SLOTS, shape.value_heads, shape.key_dim, shape.value_dim, scale=0.3),  # states
        slots,
        randn(shape.value_heads).abs(),  # A_log
        randn(shape.value_heads),  # dt_bias
    ]
