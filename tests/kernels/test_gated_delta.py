"""csrc/gated_delta.c: a Gated DeltaNet's decode step in one call, against the PyTorch step
(the model's own functions, themselves checked against a float64 reference in
tests/attention/test_linear_attention.py), on every kernel build this CPU runs: the outputs,
the conv states and the recurrent states of the requests' slots, and no other slot touched."""

from __future__ import annotations

import pytest
import torch

from gated_delta_inputs import assert_steps_match_torch, decode_inputs

from pagellm.kernels.build import load_kernels
from pagellm.attention.gated_delta_decode import DecodeChoice, DecodeShape, NativeDecode, torch_decode

@pytest.mark.parametrize(
    "heads,tiled,kernel,rows",
    [((2, 4, 8, 8), False, 4, 3), ((2, 4, 8, 8), True, 4, 5), ((4, 4, 16, 32), False, 4, 1),
     ((16, 32, 128, 128), True, 4, 2), ((1, 3, 4, 6), False, 1, 4)],
    ids=["grouped", "tiled", "one-per-key", "qwen3.5-shaped", "no-conv-history"],
)  # fmt: skip
def test_native_step_equals_the_torch_step(heads, tiled, kernel, rows, kernel_isa):
    library = load_kernels()
    assert library is not None and library.isa_level.name == kernel_isa
    shape = DecodeShape(*heads, tiled=tiled)
    args = decode_inputs(shape, rows, kernel, seed=rows)
    assert_steps_match_torch(NativeDecode(library, 2), shape, args)


def test_the_choice_is_measured_per_batch_size_and_leaves_the_states_to_the_step(kernel_isa):
    shape = DecodeShape(2, 4, 8, 8, tiled=False)
    choice = DecodeChoice.for_this_machine()
    assert choice.native is not None
    args = decode_inputs(shape, 3, 4, seed=1)
    before = [args[4].clone(), args[5].clone()]
    reference = list(args)
    reference[4], reference[5] = before[0].clone(), before[1].clone()
    out = choice.step(shape, *args)  # measures (on copies), then runs the step once
    torch.testing.assert_close(out, torch_decode(shape, *reference), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(args[5], reference[5], rtol=1e-4, atol=1e-5)
    assert set(choice._chosen) == {(shape, 4)}  # 3 rows: the bucket of 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,kernel", [(70, 4), (2, 4), (1, 4), (9, 2), (5, 1)], ids=["long", "shorter-than-history", "one", "kernel-2", "no-history"])
def test_native_prefill_conv_equals_the_torch_conv(tokens, kernel, dtype, kernel_isa):
    """A run's rows read in place from a wider projection (strided), bf16 or float32: the
    outputs and the conv state left equal PyTorch's (attention/linear_attention.causal_conv)."""
    from pagellm.attention.gated_delta_prefill import NativeConv
    from pagellm.attention.linear_attention import causal_conv

    library = load_kernels()
    assert library is not None and library.isa_level.name == kernel_isa
    g = torch.Generator().manual_seed(tokens * 10 + kernel)
    channels = 40
    projection = torch.randn(tokens, channels + 13, generator=g).to(dtype)
    x = projection[:, :channels]  # a strided view, as the model's split hands it
    weight = torch.randn(channels, kernel, generator=g) * 0.5
    state = torch.randn(channels, kernel - 1, generator=g)
    ours, reference = state.clone(), state.clone()
    out = NativeConv(library, 2)(x, ours, weight)
    torch.testing.assert_close(out, causal_conv(x, reference, weight), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_the_prefill_conv_choice_is_measured_per_size_and_runs_once(kernel_isa):
    from pagellm.attention.gated_delta_prefill import ConvChoice
    from pagellm.attention.linear_attention import causal_conv

    choice = ConvChoice.for_this_machine()
    assert choice.native is not None
    x, weight = torch.randn(6, 24), torch.randn(24, 4)
    state = torch.randn(24, 3)
    reference = state.clone()
    out = choice.run(x, state, weight)  # measures on copies of the state, then runs once
    torch.testing.assert_close(out, causal_conv(x, reference, weight), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, reference, rtol=0, atol=0)
    assert set(choice._chosen) == {(24, 4, 8)}  # 6 tokens: the bucket of 8
