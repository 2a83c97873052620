"""Attention stage: linear attention by the gated delta rule (Qwen3.5's Gated DeltaNet), in
PyTorch, over a flattened batch whose requests each own a slot of recurrent state.

Per value head, a request's state is a key x value matrix S. Token t, with decay
gamma_t = exp(g_t) <= 1 and write strength beta_t in (0, 1), updates and reads it:

    S_t = gamma_t S_{t-1} + beta_t k_t (v_t - gamma_t S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

Two forms compute it. `delta_rule_steps` applies the update once per token for many
requests at once (decode steps: one token each). `delta_rule_chunked` computes a whole
prefill chunk of one request with matrix products: within a chunk of L tokens, with
G_t = gamma_1 ... gamma_t and the written vectors d_t = beta_t (v_t - gamma_t S_{t-1}^T k_t),

    d_t = beta_t (v_t - G_t S_0^T k_t - sum_{s<t} (G_t / G_s) (k_t . k_s) d_s)

is one unit lower-triangular system for all d at once, after which
o_t = G_t S_0^T q_t + sum_{s<=t} (G_t / G_s)(q_t . k_s) d_s and
S_L = G_L S_0 + sum_s (G_L / G_s) k_s d_s^T. Both keep everything in float32.

Before the rule, each request's q, k and v pass a short causal depthwise convolution
whose last kernel_size - 1 inputs are part of the state (`causal_conv`, `causal_conv_steps`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Tokens per chunk of the chunked form: the triangular solve is L x L per head.
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True)
class LinearLayerState:
    """One linear-attention layer's state for every slot (float32)."""

    conv: torch.Tensor  # [num_slots, conv_dim, kernel_size - 1]: the latest inputs of the convolution
    recurrent: torch.Tensor  # [num_slots, num_value_heads, key_head_dim, value_head_dim]


@dataclass(frozen=True)
class LinearAttentionMetadata:
    """Which state slot each request of the flat batch owns (request r owns rows
    query_start_loc[r] : query_start_loc[r + 1], as in AttentionMetadata), each
    linear-attention layer's state, by its position among those layers, and the snapshots
    of that state the step writes."""

    state_slots: list[int]  # [num_reqs]
    layer_states: tuple[LinearLayerState, ...]
    # Per request, the snapshots to write: (rows of the request before it, snapshot slot),
    # into snapshot_states (prefix caching; core/state_snapshots.py).
    saves: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    snapshot_states: tuple[LinearLayerState, ...] = ()
    # What the first linear-attention layer of the step works out from the above for all of
    # them (which rows decode, which run a prefill chunk), by name.
    per_step: dict[str, object] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class DecodeShape:
    """The shapes of one Gated DeltaNet that a decode step needs (tiled: value head i reads
    key head i % key heads, else i // (value heads / key heads))."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    tiled: bool = False

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def causal_conv(
    x: torch.Tensor,  # [num_tokens, channels]: one request's tokens
    conv_state: torch.Tensor,  # [channels, kernel_size - 1] float32, read and then replaced
    weight: torch.Tensor,  # [channels, kernel_size]
) -> torch.Tensor:  # [num_tokens, channels] float32, after SiLU
    """The request's tokens through the causal depthwise convolution, continuing from the
    inputs its state holds (zeros for a request that starts)."""
    extended = torch.cat([conv_state, x.t().float()], dim=1)  # [channels, kernel_size - 1 + num_tokens]
    out = F.conv1d(extended.unsqueeze(0), weight.float().unsqueeze(1), groups=weight.shape[0]).squeeze(0)
    if conv_state.shape[1]:
        conv_state.copy_(extended[:, -conv_state.shape[1] :])
    return F.silu(out.t())


def causal_conv_steps(
    x: torch.Tensor,  # [num_reqs, channels]: one token per request
    conv_states: torch.Tensor,  # [num_reqs, channels, kernel_size - 1] float32 (gathered rows)
    weight: torch.Tensor,  # [channels, kernel_size]
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_reqs, channels] after SiLU, the new conv states
    extended = torch.cat([conv_states, x.float().unsqueeze(2)], dim=2)  # [num_reqs, channels, kernel_size]
    out = (extended * weight.float().unsqueeze(0)).sum(dim=2)
    return F.silu(out), extended[:, :, 1:]


def delta_rule_steps(
    q: torch.Tensor,  # [num_reqs, heads, key_dim] float32, normalized and scaled
    k: torch.Tensor,  # [num_reqs, heads, key_dim] float32, normalized
    v: torch.Tensor,  # [num_reqs, heads, value_dim] float32
    g: torch.Tensor,  # [num_reqs, heads]: log of the decay
    beta: torch.Tensor,  # [num_reqs, heads]
    state: torch.Tensor,  # [num_reqs, heads, key_dim, value_dim] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # outputs [num_reqs, heads, value_dim], the new states
    """One token of each request (a decode step)."""
    decayed = state * g.exp()[..., None, None]
    predicted = torch.einsum("rhkv,rhk->rhv", decayed, k)
    written = beta.unsqueeze(-1) * (v - predicted)
    new_state = decayed + k.unsqueeze(-1) * written.unsqueeze(-2)
    return torch.einsum("rhkv,rhk->rhv", new_state, q), new_state


def delta_rule_chunked(
    q: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized and scaled
    k: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized
    v: torch.Tensor,  # [num_tokens, heads, value_dim] float32
    g: torch.Tensor,  # [num_tokens, heads]: log of the decay
    beta: torch.Tensor,  # [num_tokens, heads]
    state: torch.Tensor,  # [heads, key_dim, value_dim] float32: before the first token
    chunk: int = DELTA_RULE_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # outputs [num_tokens, heads, value_dim], the state after
    """A run of one request's tokens (a prefill chunk), `chunk` tokens per solve."""
    outputs = []
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, num_tokens, dim]
    g, beta = g.t(), beta.t()  # [heads, num_tokens]
    for start in range(0, q.shape[1], chunk):
        end = min(start + chunk, q.shape[1])
        out, state = _one_chunk(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end], state)
        outputs.append(out)
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def _one_chunk(
    q: torch.Tensor,  # [heads, length, key_dim]
    k: torch.Tensor,
    v: torch.Tensor,  # [heads, length, value_dim]
    g: torch.Tensor,  # [heads, length]
    beta: torch.Tensor,
    state: torch.Tensor,  # [heads, key_dim, value_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    length = q.shape[1]
    log_decay = g.cumsum(dim=1)  # log G_t
    # G_t / G_s for s <= t, 0 above the diagonal (masked in log space: no overflow).
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    relative = (log_decay.unsqueeze(2) - log_decay.unsqueeze(1)).masked_fill(future, float("-inf")).exp()
    decay = log_decay.exp().unsqueeze(-1)  # [heads, length, 1]
    # (I + A) d = beta (v - G S_0^T k), A[t, s] = beta_t (G_t / G_s)(k_t . k_s) for s < t.
    system = ((k @ k.transpose(1, 2)) * relative * beta.unsqueeze(-1)).tril(-1)
    system = system + torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * (v - decay * (k @ state))
    written = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = decay * (q @ state) + ((q @ k.transpose(1, 2)) * relative) @ written
    to_end = (log_decay[:, -1:] - log_decay).exp().unsqueeze(-1)  # G_L / G_s
    new_state = decay[:, -1:] * state + (k * to_end).transpose(1, 2) @ written
    return out, new_state


__all__ = [
    "DELTA_RULE_CHUNK",
    "LinearAttentionMetadata",
    "LinearLayerState",
    "causal_conv",
    "causal_conv_steps",
    "delta_rule_chunked",
    "delta_rule_steps",
]
