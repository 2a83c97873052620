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


def _rule_run_inputs(tokens: int, heads: int, key_dim: int, value_dim: int, seed: int) -> list[torch.Tensor]:
    """A run's q, k (unit length, q scaled), v, g (log decay), beta and the state before it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(tokens, heads, key_dim, generator=g), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, key_dim, generator=g), dim=-1)
    v = torch.randn(tokens, heads, value_dim, generator=g)
    decay = -torch.rand(tokens, heads, generator=g) * 2
    beta = torch.rand(tokens, heads, generator=g)
    state = torch.randn(heads, key_dim, value_dim, generator=g) * 0.3
    return [q, k, v, decay, beta, state]


@pytest.mark.parametrize(
    "tokens,heads,key_dim,value_dim",
    [(70, 4, 16, 32), (1, 2, 8, 8), (65, 3, 12, 24), (17, 16, 128, 128)],
    ids=["past-a-chunk", "one-token", "value-dim-not-a-block", "qwen3.5-shaped"],
)
def test_native_prefill_rule_equals_the_chunked_and_the_stepped_rule(tokens, heads, key_dim, value_dim, kernel_isa):
    """csrc/gated_delta.c gated_delta_prefill_run against PyTorch's chunked form
    (attention/linear_attention.py, itself checked against a float64 reference) and the
    token-by-token steps: equal outputs and final state, the state updated in place."""
    from pagellm.attention.gated_delta_prefill import NativeDeltaRule
    from pagellm.attention.linear_attention import delta_rule_chunked, delta_rule_steps

    library = load_kernels()
    assert library is not None and library.isa_level.name == kernel_isa
    q, k, v, decay, beta, state = _rule_run_inputs(tokens, heads, key_dim, value_dim, seed=tokens + value_dim)
    expected, expected_state = delta_rule_chunked(q, k, v, decay, beta, state.clone())
    ours_state = state.clone()
    out, returned = NativeDeltaRule(library, 2)(q, k, v, decay, beta, ours_state)
    assert returned is ours_state
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_state, expected_state, rtol=1e-4, atol=1e-5)
    stepped, current = [], state.unsqueeze(0)
    for t in range(tokens):
        o, current = delta_rule_steps(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], current)
        stepped.append(o)
    torch.testing.assert_close(out, torch.cat(stepped), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours_state, current[0], rtol=1e-4, atol=1e-5)


def test_the_prefill_rule_choice_is_measured_per_size_and_updates_the_state_once(kernel_isa):
    from pagellm.attention.gated_delta_prefill import DeltaRuleChoice
    from pagellm.attention.linear_attention import delta_rule_chunked

    choice = DeltaRuleChoice.for_this_machine()
    assert choice.native is not None
    q, k, v, decay, beta, state = _rule_run_inputs(6, 2, 8, 16, seed=3)
    expected, expected_state = delta_rule_chunked(q, k, v, decay, beta, state.clone())
    out, _ = choice.run(q, k, v, decay, beta, state)  # measures on copies of the state, then runs once
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-5)
    assert set(choice._chosen) == {(2, 8, 16, 8)}  # 6 tokens: the bucket of 8
