"""Test helper: random inputs of a Gated DeltaNet decode step (the arguments of
attention/gated_delta_decode.torch_decode), and the check of a step against it, for the
native and the Triton steps' tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.attention.gated_delta_decode import DecodeShape, torch_decode

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


def assert_steps_match_torch(step: Callable[..., torch.Tensor], shape: DecodeShape, args: list[torch.Tensor]) -> None:
    """Three decode steps in a row of `step` and of attention/gated_delta_decode.torch_decode
    on copies of `args`' states (each step continuing from what the last left): equal
    outputs and states, and no slot outside the steps' rows touched."""
    ours, reference = [list(args) for _ in range(2)]
    ours[4], ours[5] = args[4].clone(), args[5].clone()
    reference[4], reference[5] = args[4].clone(), args[5].clone()
    for _ in range(3):
        out = step(shape, *ours)
        expected = torch_decode(shape, *reference)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[4], reference[4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[5], reference[5], rtol=1e-4, atol=1e-5)
    untouched = [s for s in range(NUM_SLOTS) if s not in args[6].tolist()]
    assert torch.equal(ours[5][untouched], args[5][untouched]) and torch.equal(ours[4][untouched], args[4][untouched])
