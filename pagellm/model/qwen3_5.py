"""Model stage: Qwen3.5 (dense and MoE), a hybrid: Gated DeltaNet linear attention in most layers
(`layer_types`: three of every four), gated full attention in the rest.

What differs from Qwen3, and where it lives:
- The linear-attention layer (GatedDeltaNet, below): one projection gives q, k, v (through a
  short causal depthwise convolution with SiLU), an output gate z and per-head beta and
  decay inputs; q and k are L2-normalised, the decay is exp(-exp(A_log) * softplus(a +
  dt_bias)); the gated delta rule (attention/linear_attention.py) runs over each request's
  recurrent state; its output passes an RMSNorm gated by SiLU(z). The state lives in the
  worker's slots (worker/recurrent_state.py), not in the paged KV cache.
- Full attention doubles q_proj: each head's second half gates the attention output by
  sigmoid, element-wise. q/k norms, rotary on a share of each head (partial_rotary_factor).
- Every RMSNorm but the gated one scales by (1 + w) (layers.OffsetRMSNorm).
A text-only request's positions are the same on the three multimodal rotary axes, so the
interleaved multimodal rotary is the plain one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.linear_attention import LinearAttentionMetadata
from pagellm.config.model import ModelConfig
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.model.layers import OffsetRMSNorm, RMSNorm
from pagellm.model.llama import LlamaForCausalLM, LlamaMLP
from pagellm.model.mixture_of_experts import MixtureOfExperts
from pagellm.attention.gated_delta_decode import DecodeShape, process_decode_choice, rule_inputs
from pagellm.attention.gated_delta_prefill import prefill_delta_rule, process_conv_choice
from pagellm.model.packable_layers import PackableLinear
from pagellm.model.qwen3 import Qwen3Attention
from pagellm.model.tensor_parallel import TPGroup


class GatedAttention(Qwen3Attention):
    """Qwen3 attention whose output is gated element-wise by sigmoid(gate), the gate being
    the second half of each head's q_proj rows."""

    qk_norm_class: type[RMSNorm] = OffsetRMSNorm

    def __init__(
        self, config: ModelConfig, tp: TPGroup | None = None, layer: int = 0, kernel: CpuLinearKernels | None = None
    ) -> None:
        super().__init__(config, tp, layer, kernel)
        # q and its gate (per head: head_dim of q, then head_dim of gate), k, v in one matmul.
        self.qkv_proj = PackableLinear(
            config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.attention_bias, kernel=kernel
        )

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        query_and_gate, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_and_gate = query_and_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_and_gate[..., : self.head_dim], query_and_gate[..., self.head_dim :]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.position_qk(q, k, cos_sin)
        out = backend.forward(q, k, v, kv_cache, metadata.for_group(self.kv_group), self.scale, self.sliding_window, self.softcap)
        gated = out.reshape(num_tokens, self.q_size) * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        projected = self.o_proj(gated)
        return projected if self.tp is None else self.tp.all_reduce(projected)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times w (not 1 + w), times SiLU(gate): in float32,
    rounded to the model's dtype after the norm and at the end, as the reference does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., hidden_size] each
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer: the gated delta rule over each request's recurrent state
    (its slot in the metadata's layer state number `index`). Under tensor parallelism
    `config` holds this rank's heads, and out_proj's partial sums are all-reduced."""

    def __init__(
        self, config: ModelConfig, index: int, kernel: CpuLinearKernels | None = None, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        spec = config.linear_attention
        assert spec is not None
        self.tp = tp
        self.index = index  # among the model's linear-attention layers
        self.num_value_heads, self.value_head_dim = spec.num_value_heads, spec.value_head_dim
        self.value_size = spec.num_value_heads * spec.value_head_dim
        self.conv_dim = spec.conv_dim
        # q, k, v (the convolution's channels), then the output gate z, then beta's and the
        # decay's inputs (one per value head): one matmul.
        self.in_proj = PackableLinear(
            config.hidden_size, self.conv_dim + self.value_size + 2 * self.num_value_heads, bias=False, kernel=kernel
        )
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, spec.conv_kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_value_heads))
        self.norm = GatedRMSNorm(self.value_head_dim, config.rms_norm_eps)
        self.out_proj = PackableLinear(self.value_size, config.hidden_size, bias=False, kernel=kernel)
        self.shape = DecodeShape(spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim,
                                 spec.value_heads_tiled)  # fmt: skip
        # Decode steps and prefill runs' convolutions: PyTorch's or one native call,
        # whichever is measured faster here.
        self.decode_choice = process_decode_choice()
        self.conv_choice = process_conv_choice()

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        mixed, z, b, a = self.split_projection(self.in_proj(hidden))
        core = self.mix(mixed, b, a, metadata)
        gated = self.norm(core.to(hidden.dtype), z.reshape(num_tokens, self.num_value_heads, self.value_head_dim))
        projected = self.out_proj(gated.reshape(num_tokens, self.value_size))
        return projected if self.tp is None else self.tp.all_reduce(projected)

    def split_projection(self, projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """in_proj's output as the conv's channels, the output gate z, beta's and the decay's inputs."""
        return projected.split([self.conv_dim, self.value_size, self.num_value_heads, self.num_value_heads], dim=-1)

    def mix(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, value_heads, value_dim] float32
        """The token mixing: the conv and the gated delta rule over each request's state (its
        slot updated), the snapshots the step asks for taken."""
        linear = metadata.linear
        assert linear is not None, "a hybrid model's step carries its recurrent state"
        num_tokens = mixed.shape[0]
        split = linear.per_step.get("split")
        if split is None:  # once per step, for every layer
            split = linear.per_step["split"] = _split_requests(metadata.query_start_loc, linear)
        single, runs = split  # type: ignore[misc]
        if not runs and single.slots is not None and single.slots.shape[0] == num_tokens:  # decode steps: every row, in order
            core = self._decode(mixed, b, a, linear, single)
        else:
            core = torch.empty(num_tokens, self.num_value_heads, self.value_head_dim, dtype=torch.float32, device=mixed.device)
            if single.rows is not None:  # decode steps, together
                core[single.rows] = self._decode(mixed[single.rows], b[single.rows], a[single.rows], linear, single)
            self._prefill(mixed, b, a, linear, runs, core)  # prefill chunks, one request at a time
        return core

    def _decode(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, linear: LinearAttentionMetadata, single: _Rows
    ) -> torch.Tensor:  # [rows, value_heads, value_dim] float32
        states = linear.layer_states[self.index]
        conv_weight, a_log, dt_bias = self.float32_parameters()
        out = self.decode_choice.step(
            self.shape, mixed, b, a, conv_weight, states.conv, states.recurrent, single.slots, a_log, dt_bias
        )
        snapshots = linear.snapshot_states[self.index] if single.saves else None
        for slot, snapshot in single.saves:  # the state after the step's token
            assert snapshots is not None
            snapshots.conv[snapshot] = states.conv[slot]
            snapshots.recurrent[snapshot] = states.recurrent[slot]
        return out

    def float32_parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv weight [conv_dim, kernel], A_log and dt_bias as the decode step reads them
        (float32, contiguous), made once: the weights do not change after loading."""
        cached = getattr(self, "_float32_cache", None)
        source = (self.conv1d.weight, self.A_log, self.dt_bias)
        if cached is None or any(p.data_ptr() != ptr for p, ptr in zip(source, cached[1], strict=True)):
            made = tuple(p.detach().float().contiguous() for p in (self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias))
            cached = self._float32_cache = (made, tuple(p.data_ptr() for p in source))
        return cached[0]  # type: ignore[return-value]

    def _prefill(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, linear: LinearAttentionMetadata,
        runs: list[_Run], core: torch.Tensor,
    ) -> None:  # fmt: skip
        """The runs' rows of `core`: each request's tokens through the conv and the chunked delta rule."""
        if sum(run.end - run.start for run in runs) < mixed.shape[0]:  # decodes too: the runs' rows alone
            rows = torch.cat([torch.arange(run.start, run.end, device=mixed.device) for run in runs])
            offset, packed = 0, []
            for run in runs:
                packed.append(dataclasses.replace(run, start=offset, end=offset + run.end - run.start))
                offset += run.end - run.start
            core[rows] = self._prefill_rows(mixed[rows], b[rows], a[rows], linear, packed)
        else:
            core[:] = self._prefill_rows(mixed, b, a, linear, runs)

    def _prefill_rows(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, linear: LinearAttentionMetadata, runs: list[_Run]
    ) -> torch.Tensor:  # [num_tokens, value_heads, value_dim] float32: the runs cover every row
        conv = self._convolve(mixed, linear, runs)  # [num_tokens, conv_dim] float32
        q, k, v, g, beta = rule_inputs(self.shape, conv, b, a, self.A_log, self.dt_bias)
        return self._delta_rule(q, k, v, g, beta, linear, runs)

    def _convolve(self, mixed: torch.Tensor, linear: LinearAttentionMetadata, runs: list[_Run]) -> torch.Tensor:
        state = linear.layer_states[self.index].conv
        weight = self.float32_parameters()[0]  # [conv_dim, kernel_size]
        if len(runs) == 1 and not runs[0].saves and runs[0].end - runs[0].start == mixed.shape[0]:
            return self.conv_choice.run(mixed, state[runs[0].slot], weight)  # one request's rows: no copy
        out = torch.empty(mixed.shape, dtype=torch.float32, device=mixed.device)
        for run in runs:
            history = state[run.slot].clone() if run.saves else None
            out[run.start : run.end] = self.conv_choice.run(mixed[run.start : run.end], state[run.slot], weight)
            if history is not None:  # the inputs before each boundary: the state there
                inputs = torch.cat([history, mixed[run.start : run.end].t().float()], dim=1)
                for offset, snapshot in run.saves:
                    linear.snapshot_states[self.index].conv[snapshot] = inputs[:, offset : offset + history.shape[1]]
        return out

    def _delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        linear: LinearAttentionMetadata,
        runs: list[_Run],
    ) -> torch.Tensor:
        state = linear.layer_states[self.index].recurrent
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for run in runs:
            # Cut at each snapshot's boundary: the state there is the one a segment ends with.
            start, current = run.start, state[run.slot]  # updated in place
            for end, snapshot in [(run.start + offset, snapshot) for offset, snapshot in run.saves] + [(run.end, None)]:
                if end > start:
                    part = slice(start, end)
                    out[part] = prefill_delta_rule(q[part], k[part], v[part], g[part], beta[part], current)
                if snapshot is not None:
                    linear.snapshot_states[self.index].recurrent[snapshot] = current
                start = end
        return out


class _Rows:
    """The requests of a step that compute one token: their rows and state slots, and the
    snapshots to take of those slots after the token, as (slot, snapshot)."""

    def __init__(self, rows: list[int], slots: list[int], saves: list[tuple[int, int]], device: torch.device) -> None:
        self.rows = torch.tensor(rows, device=device) if rows else None
        self.slots = torch.tensor(slots, device=device) if slots else None
        self.saves = saves


@dataclass(frozen=True)
class _Run:
    """A request computing several tokens (a prefill chunk): rows start .. end - 1, its
    state slot, and the snapshots to take within it, as (rows before it, snapshot)."""

    start: int
    end: int
    slot: int
    saves: list[tuple[int, int]]


def _split_requests(query_start_loc: list[int], linear: LinearAttentionMetadata) -> tuple[_Rows, list[_Run]]:
    """The step's one-token requests (decode steps: computed together) and its longer runs
    (prefill chunks: one request at a time)."""
    rows, slots, single_saves, runs = [], [], [], []
    for request, slot in enumerate(linear.state_slots):
        start, end = query_start_loc[request], query_start_loc[request + 1]
        saves = linear.saves[request] if linear.saves else []
        if end - start == 1:
            rows.append(start)
            slots.append(slot)
            single_saves.extend((slot, snapshot) for _, snapshot in saves)
        elif end > start:
            runs.append(_Run(start, end, slot, sorted(saves)))
    device = linear.layer_states[0].conv.device
    return _Rows(rows, slots, single_saves, device), runs


class HybridDecoderLayer(nn.Module):
    """A pre-norm residual layer whose token mixer is gated attention or a GatedDeltaNet."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup | None = None,
        attention_class: type[GatedAttention] = GatedAttention,
        mlp: nn.Module | None = None,
        layer: int = 0,
        kernel: CpuLinearKernels | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        spec = config.linear_attention
        if spec is not None and layer in spec.layers:
            self.linear_attn: GatedDeltaNet | None = GatedDeltaNet(config, spec.layers.index(layer), kernel, tp)
            self.self_attn: GatedAttention | None = None
        else:
            self.linear_attn = None
            self.self_attn = attention_class(config, tp, layer, kernel)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp, kernel=kernel) if mlp is None else mlp

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.linear_attn is not None:
            hidden = hidden + self.linear_attn(normed, metadata)
        else:
            assert self.self_attn is not None
            hidden = hidden + self.self_attn(cos_sin, normed, kv_cache, metadata, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3_5ForCausalLM(LlamaForCausalLM):  # noqa: N801 - the architecture's name
    attention_class = GatedAttention
    layer_class = HybridDecoderLayer  # type: ignore[assignment]
    norm_class = OffsetRMSNorm
    # The linear-attention projections, fused into in_proj in this order.
    stacked_params = {
        **LlamaForCausalLM.stacked_params,
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer (empty for a linear-attention layer)
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed(input_ids)
        cos_sin = self.rotary.lookup(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(cos_sin, hidden, kv_cache, metadata, self.backend)
        return self.norm(hidden)


class Qwen3_5MoeForCausalLM(MixtureOfExperts, Qwen3_5ForCausalLM):  # noqa: N801 - the architecture's name
    """Qwen3.5's hybrid layers with a sparse MLP in each: routed experts (softmax, top-k,
    renormalized) and a shared expert behind a sigmoid gate."""
