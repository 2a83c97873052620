"""attention/triton_gated_delta.py: a Gated DeltaNet's decode step in Triton (run by the
interpreter on CPU tensors here), against the PyTorch step: the outputs, the conv states
and the recurrent states of the requests' slots over three steps in a row, no other slot
touched; and bfloat16 projections read as the model hands them (strided slices)."""

from __future__ import annotations

import pytest
import torch
from gated_delta_inputs import assert_steps_match_torch, decode_inputs

from pagellm.attention.gated_delta_decode import DecodeShape, torch_decode
from pagellm.attention.triton_gated_delta import triton_decode


@pytest.mark.parametrize(
    "heads,tiled,kernel,rows",
    [((2, 4, 8, 8), False, 4, 3), ((2, 4, 8, 8), True, 4, 5), ((4, 4, 16, 32), False, 4, 1),
     ((4, 8, 128, 128), True, 4, 2), ((1, 3, 4, 6), False, 1, 4), ((1, 2, 12, 80), False, 3, 2)],
    ids=["grouped", "tiled", "one-per-key", "qwen3.5-head-dims", "no-conv-history", "dims-not-powers-of-two"],
)  # fmt: skip
def test_triton_step_equals_the_torch_step(heads, tiled, kernel, rows):
    shape = DecodeShape(*heads, tiled=tiled)
    args = decode_inputs(shape, rows, kernel, seed=rows)
    assert_steps_match_torch(triton_decode, shape, args)


def test_bfloat16_projection_slices_as_the_model_passes_them():
    """The model splits one projection's bfloat16 output into the conv channels, z, b and a:
    strided views, which the step reads in place of contiguous float32 copies."""
    shape = DecodeShape(2, 4, 8, 8, tiled=True)
    args = decode_inputs(shape, 3, 4, seed=5)
    fused = torch.cat([args[0], torch.randn(3, 32), args[1], args[2]], dim=1).to(torch.bfloat16)
    mixed, _, b, a = fused.split([shape.conv_dim, 32, shape.value_heads, shape.value_heads], dim=1)
    ours, reference = list(args), list(args)
    ours[0:3], reference[0:3] = [mixed, b, a], [mixed, b, a]
    ours[4], ours[5] = args[4].clone(), args[5].clone()
    reference[4], reference[5] = args[4].clone(), args[5].clone()
    torch.testing.assert_close(triton_decode(shape, *ours), torch_decode(shape, *reference), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[5], reference[5], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens,dims", [(1, (4, 8, 8)), (70, (3, 8, 16)), (19, (2, 12, 80))], ids=["one", "past-a-chunk", "odd-dims"])
def test_triton_prefill_run_equals_the_chunked_rule(tokens, dims):
    """A prefill run token after token in Triton: the chunked form's outputs and final state
    (attention/linear_attention.delta_rule_chunked, itself checked against float64)."""
    from pagellm.attention.linear_attention import delta_rule_chunked
    from pagellm.attention.triton_gated_delta import triton_delta_rule_run

    heads, key_dim, value_dim = dims
    g = torch.Generator().manual_seed(tokens)

    def unit(*size: int) -> torch.Tensor:
        x = torch.randn(*size, generator=g)
        return x / x.norm(dim=-1, keepdim=True)

    q, k = unit(tokens, heads, key_dim) * key_dim**-0.5, unit(tokens, heads, key_dim)
    v = torch.randn(tokens, heads, value_dim, generator=g)
    decay_log = -torch.rand(tokens, heads, generator=g)
    beta = torch.rand(tokens, heads, generator=g)
    state = torch.randn(heads, key_dim, value_dim, generator=g) * 0.3
    expected, expected_state = delta_rule_chunked(q, k, v, decay_log, beta, state.clone())
    ours_state = state.clone()
    out, returned = triton_delta_rule_run(q, k, v, decay_log, beta, ours_state)
    assert returned is ours_state  # in place
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_state, expected_state, rtol=1e-4, atol=1e-4)
