"""The gated delta rule's two forms (chunked for prefill runs, one step per token for
decode) and the short causal convolution, against a float64 token-by-token reference."""

import pytest
import torch
import torch.nn.functional as F

from pagellm.attention.linear_attention import causal_conv, causal_conv_steps, delta_rule_chunked, delta_rule_steps


def inputs(num_tokens: int, heads: int = 3, key_dim: int = 8, value_dim: int = 5, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(num_tokens, heads, key_dim, generator=generator), dim=-1) * key_dim**-0.5
    k = F.normalize(torch.randn(num_tokens, heads, key_dim, generator=generator), dim=-1)
    v = torch.randn(num_tokens, heads, value_dim, generator=generator)
    g = -2.0 * torch.rand(num_tokens, heads, generator=generator)  # decays from 1 down to e^-2
    beta = torch.rand(num_tokens, heads, generator=generator)
    state = torch.randn(heads, key_dim, value_dim, generator=generator)
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state):  # noqa: ANN001, ANN201 - float64, one token at a time
    state = state.double()
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t].double())
        written = beta[t].double()[:, None] * (v[t].double() - predicted)
        state = state + k[t].double()[:, :, None] * written[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t].double()))
    return torch.stack(outputs), state


@pytest.mark.parametrize("num_tokens,chunk", [(1, 64), (7, 64), (64, 64), (65, 64), (150, 64), (150, 16), (33, 5)])
def test_chunked_form_equals_the_step_by_step_rule(num_tokens, chunk):
    q, k, v, g, beta, state = inputs(num_tokens)
    want_out, want_state = reference(q, k, v, g, beta, state)
    out, new_state = delta_rule_chunked(q, k, v, g, beta, state.clone(), chunk=chunk)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(new_state.double(), want_state, rtol=0, atol=2e-5)


def test_step_form_for_a_batch_of_requests_equals_the_rule():
    # Three requests with states of their own, ten tokens each, one token per call.
    requests = [inputs(10, seed=s) for s in range(3)]
    states = torch.stack([r[5] for r in requests])
    outs = []
    for t in range(10):
        q, k, v, g, beta = (torch.stack([r[i][t] for r in requests]) for i in range(5))
        out, states = delta_rule_steps(q, k, v, g, beta, states)
        outs.append(out)
    for index, request in enumerate(requests):
        want_out, want_state = reference(*request)
        torch.testing.assert_close(torch.stack([o[index] for o in outs]).double(), want_out, rtol=0, atol=2e-5)
        torch.testing.assert_close(states[index].double(), want_state, rtol=0, atol=2e-5)


def test_a_run_split_anywhere_carries_its_state():
    q, k, v, g, beta, state = inputs(90)
    whole, whole_state = delta_rule_chunked(q, k, v, g, beta, state.clone())
    first, mid_state = delta_rule_chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], state.clone())
    second, end_state = delta_rule_chunked(q[37:], k[37:], v[37:], g[37:], beta[37:], mid_state)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=0, atol=1e-5)
    torch.testing.assert_close(end_state, whole_state, rtol=0, atol=1e-5)


def test_the_convolution_continues_from_its_state():
    torch.manual_seed(0)
    channels, kernel = 6, 4
    x = torch.randn(20, channels)
    weight = torch.randn(channels, kernel)
    # One shot, zero history: F.conv1d with kernel - 1 zeros before the first input.
    want = F.silu(F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), padding=kernel - 1, groups=channels)[0, :, :20].t())
    state = torch.zeros(channels, kernel - 1)
    parts = [causal_conv(x[:7], state, weight), causal_conv(x[7:8], state, weight)]
    steps = state.clone().unsqueeze(0)
    for t in range(8, 12):  # one token at a time, as a decode step
        out, steps = causal_conv_steps(x[t : t + 1], steps, weight)
        parts.append(out)
    state.copy_(steps[0])
    parts.append(causal_conv(x[12:], state, weight))
    torch.testing.assert_close(torch.cat(parts), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, x[-(kernel - 1) :].t())
