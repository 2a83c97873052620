"""Attention stage: GPU: a Gated DeltaNet's decode step in Triton, on each decoding
request's state slot in place (the CPU's is csrc/gated_delta.c, the reference
attention/gated_delta_decode.torch_decode).

Two kernels, so that no program reads a conv state another one is rewriting:

- `conv_step`: one program per (request, block of channels): the short causal conv of the
  token with the last kernel - 1 inputs of its state, SiLU, into a float32 scratch row; the
  state shifts by one and takes the token.
- `delta_rule_step`: one program per (request, value head, block of value dims): the q/k
  head the value head reads (L2-normalised, q scaled by key_dim^-0.5), the decay
  exp(-exp(A_log) * softplus(a + dt_bias)) and beta = sigmoid(b), then the rule on that
  value head's [key_dim, value block] tile of the state: decay, predict v from k, write
  beta * (v - prediction) along k, read out along q.
- `delta_rule_run`: a prefill run of one request (its q, k, v, decay and beta already
  computed, per value head), token after token in one program per (value head, block of
  value dims) that keeps its [key_dim, value block] tile of the state in registers for the
  whole run: the recurrent form of the rule, on the GPU in place of the chunked one.

All run under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, which is how the
CPU test suite checks them against the PyTorch step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.attention.linear_attention import DecodeShape


@triton.jit
def conv_step_kernel(
    mixed_ptr,  # [R, C] the step's projected channels
    weight_ptr,  # [C, KERNEL] float32
    conv_states_ptr,  # [slots, C, KERNEL - 1] float32, updated in place
    slots_ptr,  # [R] int64
    out_ptr,  # [R, C] float32: after SiLU
    mixed_stride,
    CHANNELS: tl.constexpr,
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = channels < CHANNELS
    slot = tl.load(slots_ptr + row)
    state = conv_states_ptr + slot * CHANNELS * (KERNEL - 1) + channels * (KERNEL - 1)
    token = tl.load(mixed_ptr + row * mixed_stride + channels, mask=mask, other=0.0).to(tl.float32)
    total = token * tl.load(weight_ptr + channels * KERNEL + KERNEL - 1, mask=mask, other=0.0)
    for tap in tl.static_range(KERNEL - 1):
        earlier = tl.load(state + tap, mask=mask, other=0.0)
        total += earlier * tl.load(weight_ptr + channels * KERNEL + tap, mask=mask, other=0.0)
        if tap > 0:  # shift: the state keeps the last KERNEL - 1 inputs
            tl.store(state + tap - 1, earlier, mask=mask)
    if KERNEL > 1:
        tl.store(state + KERNEL - 2, token, mask=mask)
    tl.store(out_ptr + row * CHANNELS + channels, total * tl.sigmoid(total), mask=mask)


@triton.jit
def delta_rule_step_kernel(
    conv_ptr,  # [R, C] float32: q, k, v after the conv
    b_ptr,  # [R, VALUE_HEADS]
    a_ptr,
    a_log_ptr,  # [VALUE_HEADS] float32
    dt_bias_ptr,
    states_ptr,  # [slots, VALUE_HEADS, KEY_DIM, VALUE_DIM] float32, updated in place
    slots_ptr,  # [R] int64
    out_ptr,  # [R, VALUE_HEADS, VALUE_DIM] float32
    gate_stride,
    scale,  # key_dim ** -0.5
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    TILED: tl.constexpr,  # value head i reads key head i % KEY_HEADS (else i // (VALUE_HEADS / KEY_HEADS))
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, BLOCK_K)
    key_mask, value_mask = keys < KEY_DIM, dims < VALUE_DIM
    if TILED:
        key_head = head % KEY_HEADS
    else:
        key_head = head // (VALUE_HEADS // KEY_HEADS)
    channels = KEY_HEADS * KEY_DIM * 2 + VALUE_HEADS * VALUE_DIM
    base = conv_ptr + row * channels
    q = tl.load(base + key_head * KEY_DIM + keys, mask=key_mask, other=0.0)
    k = tl.load(base + KEY_HEADS * KEY_DIM + key_head * KEY_DIM + keys, mask=key_mask, other=0.0)
    v = tl.load(base + 2 * KEY_HEADS * KEY_DIM + head * VALUE_DIM + dims, mask=value_mask, other=0.0)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    gate_in = tl.load(a_ptr + row * gate_stride + head).to(tl.float32) + tl.load(dt_bias_ptr + head)
    # softplus as torch computes it: x itself above 20
    softplus = tl.where(gate_in > 20.0, gate_in, tl.log(1.0 + tl.exp(gate_in)))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head)) * softplus)
    beta = tl.sigmoid(tl.load(b_ptr + row * gate_stride + head).to(tl.float32))
    slot = tl.load(slots_ptr + row)
    tile = states_ptr + ((slot * VALUE_HEADS + head) * KEY_DIM + keys[:, None]) * VALUE_DIM + dims[None, :]
    tile_mask = key_mask[:, None] & value_mask[None, :]
    state = tl.load(tile, mask=tile_mask, other=0.0) * decay
    predicted = tl.sum(state * k[:, None], axis=0)
    written = beta * (v - predicted)
    state += k[:, None] * written[None, :]
    tl.store(tile, state, mask=tile_mask)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (row * VALUE_HEADS + head) * VALUE_DIM + dims, out, mask=value_mask)


@triton.jit
def delta_rule_run_kernel(
    q_ptr,  # [T, HEADS, KEY_DIM] float32: L2-normalised and scaled, one per value head
    k_ptr,  # [T, HEADS, KEY_DIM] float32: L2-normalised
    v_ptr,  # [T, HEADS, VALUE_DIM] float32
    g_ptr,  # [T, HEADS] float32: log of the decay
    beta_ptr,  # [T, HEADS] float32
    state_ptr,  # [HEADS, KEY_DIM, VALUE_DIM] float32, updated in place
    out_ptr,  # [T, HEADS, VALUE_DIM] float32
    tokens,
    HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    head = tl.program_id(0)
    dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, BLOCK_K)
    key_mask, value_mask = keys < KEY_DIM, dims < VALUE_DIM
    tile = state_ptr + (head * KEY_DIM + keys[:, None]) * VALUE_DIM + dims[None, :]
    tile_mask = key_mask[:, None] & value_mask[None, :]
    state = tl.load(tile, mask=tile_mask, other=0.0)
    for t in range(tokens):
        q = tl.load(q_ptr + (t * HEADS + head) * KEY_DIM + keys, mask=key_mask, other=0.0)
        k = tl.load(k_ptr + (t * HEADS + head) * KEY_DIM + keys, mask=key_mask, other=0.0)
        v = tl.load(v_ptr + (t * HEADS + head) * VALUE_DIM + dims, mask=value_mask, other=0.0)
        decay = tl.exp(tl.load(g_ptr + t * HEADS + head))
        beta = tl.load(beta_ptr + t * HEADS + head)
        state = state * decay
        predicted = tl.sum(state * k[:, None], axis=0)
        written = beta * (v - predicted)
        state += k[:, None] * written[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + (t * HEADS + head) * VALUE_DIM + dims, out, mask=value_mask)
    tl.store(tile, state, mask=tile_mask)


def triton_delta_rule_run(
    q: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized and scaled
    k: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized
    v: torch.Tensor,  # [num_tokens, heads, value_dim] float32
    g: torch.Tensor,  # [num_tokens, heads]: log of the decay
    beta: torch.Tensor,  # [num_tokens, heads]
    state: torch.Tensor,  # [heads, key_dim, value_dim] float32, contiguous: updated in place
) -> tuple[torch.Tensor, torch.Tensor]:  # outputs [num_tokens, heads, value_dim], the state after
    """attention/linear_attention.delta_rule_chunked's result, token after token in Triton."""
    tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    assert state.is_contiguous() and state.dtype == torch.float32
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    out = torch.empty(tokens, heads, value_dim, dtype=torch.float32, device=v.device)
    block_v = min(64, triton.next_power_of_2(value_dim))
    if tokens:
        delta_rule_run_kernel[(heads, triton.cdiv(value_dim, block_v))](
            q, k, v, g, beta, state, out, tokens, HEADS=heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
            BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v,
        )  # fmt: skip
    return out, state


def triton_decode(
    shape: DecodeShape,
    mixed: torch.Tensor,  # [R, conv dim]
    b: torch.Tensor,  # [R, value heads]
    a: torch.Tensor,
    conv_weight: torch.Tensor,  # [conv dim, kernel]
    conv_states: torch.Tensor,  # [slots, conv dim, kernel - 1] float32
    states: torch.Tensor,  # [slots, value heads, key dim, value dim] float32
    slots: torch.Tensor,  # [R] int64
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:  # [R, value heads, value dim] float32; the slots' states updated
    """The decode step in the two Triton kernels (the arguments are torch_decode's)."""
    rows, channels = mixed.shape
    assert conv_states.is_contiguous() and states.is_contiguous() and states.dtype == torch.float32
    mixed = mixed if mixed.stride(1) == 1 else mixed.contiguous()
    b, a = b.contiguous(), a.contiguous()
    f32 = torch.float32
    weight = conv_weight.to(f32).contiguous()
    slots = slots.to(torch.int64).contiguous()
    conv = torch.empty(rows, channels, dtype=f32, device=mixed.device)
    out = torch.empty(rows, shape.value_heads, shape.value_dim, dtype=f32, device=mixed.device)
    if rows == 0:
        return out
    block_c = min(1024, triton.next_power_of_2(channels))
    conv_step_kernel[(rows, triton.cdiv(channels, block_c))](
        mixed, weight, conv_states, slots, conv, mixed.stride(0), CHANNELS=channels, KERNEL=weight.shape[1], BLOCK_C=block_c
    )
    block_v = min(64, triton.next_power_of_2(shape.value_dim))
    delta_rule_step_kernel[(rows, shape.value_heads, triton.cdiv(shape.value_dim, block_v))](
        conv, b, a, a_log.to(f32).contiguous(), dt_bias.to(f32).contiguous(), states, slots, out, b.stride(0),
        shape.key_dim**-0.5, KEY_HEADS=shape.key_heads, VALUE_HEADS=shape.value_heads, KEY_DIM=shape.key_dim, VALUE_DIM=shape.value_dim,
        TILED=shape.tiled, BLOCK_K=triton.next_power_of_2(shape.key_dim), BLOCK_V=block_v,
    )  # fmt: skip
    return out


__all__ = ["conv_step_kernel", "delta_rule_run_kernel", "delta_rule_step_kernel", "triton_decode", "triton_delta_rule_run"]
