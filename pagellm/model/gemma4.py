"""Model stage: Gemma 4 (text): Gemma 3's sandwich-normed layers with per-layer inputs,
KV-shared layers, global heads of their own shape and an experts' block beside the MLP.

What differs from Gemma 3, and where it lives:
- Norms scale by w (not 1 + w), in float32 (Gemma4RMSNorm); q and k are normalized per
  head, v too (without a scale); scores are not scaled (ModelConfig.attention_scale 1).
- Global (full-attention) layers have heads of their own size and count
  (ModelConfig.layer_head_dim / layer_kv_heads), their keys may serve as values
  (attention_k_eq_v: v is the k projection before k's norm), and their rotary turns only
  the first global_rotated_share of the frequencies ("proportional": gemma4_rotary_tables).
- The last num_kv_shared_layers layers compute no K/V: each attends over this step's K/V
  of its owner, the last earlier layer of its kind (ModelConfig.kv_owner), and reads and
  writes the owner's cache, holding none of its own (config/kv_layout.py). Their MLPs may
  be twice as wide.
- Per-layer inputs: each token gets, for every layer, a small vector from its own
  embedding table and a projection of its embedding (per_layer_inputs); after the MLP a
  layer gates it by its hidden state, projects it back and adds it (Gemma4DecoderLayer).
- 26B-A4B: every layer runs an experts' block beside its dense MLP (Gemma4MoeBlock), with
  its own norms, routed from the residual stream.
- Each layer's output is multiplied by a learned scalar; logits are soft-capped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.config.model import ModelConfig
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.kernels.weights import WeightPart
from pagellm.model.layers import RotaryEmbedding, apply_rotary, apply_rotary_one
from pagellm.model.llama import LlamaForCausalLM, LlamaMLP
from pagellm.model.mixture_of_experts import SparseMoeBlock
from pagellm.model.packable_layers import PackableEmbedding, PackableLinear
from pagellm.model.tensor_parallel import TPGroup

# This step's K and V of each layer that other layers read ([tokens, kv_heads, head_dim] each).
StepKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


class Gemma4RMSNorm(nn.Module):
    """x / rms(x) * w in float32, rounded once (no weight: Gemma 4's v norm and router norm)."""

    def __init__(self, size: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            x32 = x32 * self.weight.float()
        return x32.to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, tp: TPGroup | None = None, layer: int = 0, kernel: CpuLinearKernels | None = None
    ) -> None:
        super().__init__()
        self.tp = tp  # o_proj is row-parallel: its partial sums are all-reduced
        self.layer = layer
        self.owner = config.kv_owner(layer)
        self.sliding_window = config.layer_window(layer)
        self.kv_group = kv_cache_layout(config).group_of_layer(layer)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.layer_kv_heads(layer)
        self.head_dim = config.layer_head_dim(layer)
        self.scale = config.attention_scale or 1.0
        self.softcap = config.attn_logit_softcapping
        self.sinks = None
        h, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = PackableLinear(h, q_size, bias=config.attention_bias, kernel=kernel)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        if self.owner == layer:  # a KV-shared layer has neither k nor v projections
            self.k_proj = PackableLinear(h, kv_size, bias=config.attention_bias, kernel=kernel)
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
            # Keys as values (attention_k_eq_v): no v projection.
            has_value = config.layer_has_value_projection(layer)
            self.v_proj = PackableLinear(h, kv_size, bias=config.attention_bias, kernel=kernel) if has_value else None
        self.o_proj = PackableLinear(q_size, h, bias=config.attention_bias, kernel=kernel)

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (the owner's)
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        step_kv: StepKV,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim))
        if self.owner == self.layer:
            raw_k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
            raw_v = raw_k if self.v_proj is None else self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary(q, self.k_norm(raw_k), cos_sin)
            v = self.v_norm(raw_v)
            step_kv[self.layer] = (k, v)
        else:
            # The owner's K/V of this step (its cache holds the earlier ones): writing them
            # again is a no-op, and the backend reads them as the owner did.
            k, v = step_kv[self.owner]
            q = apply_rotary_one(q, cos_sin)
        out = backend.forward(
            q, k, v, kv_cache, metadata.for_group(self.kv_group), self.scale, self.sliding_window, self.softcap, None
        )
        projected = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return projected if self.tp is None else self.tp.all_reduce(projected)


class Gemma4MoeBlock(SparseMoeBlock):
    """The experts beside the dense MLP: the router reads the residual stream (normalized
    without a weight, times its own scale and hidden_size^-0.5), softmaxes over all
    experts, keeps the top-k renormalized and scales each by its expert's learned factor."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, kernel: CpuLinearKernels | None = None) -> None:
        super().__init__(config, tp, kernel)
        self.router_norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.router_scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.root_size = config.hidden_size**-0.5

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """The experts' weighted sum for rows `x`, routed by `residual` ([rows, hidden] each)."""
        routed = self.router_norm(residual) * self.router_scale * self.root_size
        weights, experts = self.route(self.router_logits(routed))
        weights = weights * self.per_expert_scale.float()[experts]
        out = self.run_experts(x, weights, experts)
        # Each rank holds a slice of every expert: the sum is whole before its norm.
        return out if self.tp is None else self.tp.all_reduce(out)


class Gemma4DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup | None = None,
        attention_class: type[Gemma4Attention] = Gemma4Attention,
        mlp: nn.Module | None = None,
        layer: int = 0,
        kernel: CpuLinearKernels | None = None,
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.self_attn = attention_class(config, tp, layer, kernel)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        assert mlp is not None
        self.mlp = mlp
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.moe: Gemma4MoeBlock | None = None
        if config.experts_beside_mlp:
            self.moe = Gemma4MoeBlock(config, tp, kernel)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        self.per_layer_input_size = config.per_layer_input_size
        if self.per_layer_input_size:
            self.per_layer_input_gate = PackableLinear(h, self.per_layer_input_size, bias=False, kernel=kernel)
            self.per_layer_projection = PackableLinear(self.per_layer_input_size, h, bias=False, kernel=kernel)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        step_kv: StepKV,
        per_layer_input: torch.Tensor | None,  # [num_tokens, per_layer_input_size]
    ) -> torch.Tensor:
        attended = self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, metadata, backend, step_kv)
        residual = hidden + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.moe is not None:
            experts = self.moe(residual, self.pre_feedforward_layernorm_2(residual))
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden = residual + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar.to(hidden.dtype)


# HF names of one layer's router and stacked experts -> ours (the experts are cut into
# per-expert projections by loader/checkpoint_layouts.py, which renames them under `moe`).
_RENAMED = {".router.proj.": ".moe.gate.", ".router.scale": ".moe.router_scale", ".router.per_expert_scale": ".moe.per_expert_scale"}
_SHARED_LAYER_TENSORS = ("k_proj", "v_proj", "k_norm", "v_norm")


class Gemma4ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma4DecoderLayer  # type: ignore[assignment]
    attention_class = Gemma4Attention  # type: ignore[assignment]
    norm_class = Gemma4RMSNorm  # type: ignore[assignment]
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rope_freq_divisors: torch.Tensor | None = None,
        tp: TPGroup | None = None,
        kernel: CpuLinearKernels | None = None,
    ) -> None:
        super().__init__(config, backend, rope_freq_divisors, tp, kernel)
        size = config.per_layer_input_size
        if size:
            layers = config.num_hidden_layers
            self.embed_tokens_per_layer = PackableEmbedding(config.per_layer_input_vocab_size, layers * size)
            self.per_layer_model_projection = PackableLinear(config.hidden_size, layers * size, bias=False, kernel=kernel)
            self.per_layer_projection_norm = Gemma4RMSNorm(size, config.rms_norm_eps)

    @staticmethod
    def rotary_tables_for(
        config: ModelConfig, freq_divisors: torch.Tensor | None = None
    ) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        return gemma4_rotary_tables(config)

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, layer: int, kernel: CpuLinearKernels | None = None) -> nn.Module:
        return LlamaMLP(config, tp, config.mlp_intermediate_size(layer), kernel)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer (a KV-shared layer: its owner's)
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, hidden)
        global_cos_sin = self.rotary.lookup(positions, hidden.dtype)
        assert self.local_rotary is not None
        local_cos_sin = self.local_rotary.lookup(positions, hidden.dtype)
        step_kv: StepKV = {}
        for index, layer in enumerate(self.layers):
            cos_sin = global_cos_sin if layer.self_attn.sliding_window is None else local_cos_sin
            layer_input = None if per_layer is None else per_layer[:, index]
            hidden = layer(cos_sin, hidden, kv_caches[index], metadata, self.backend, step_kv, layer_input)
        return self.norm(hidden)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """[num_tokens, layers, size]: each token's own per-layer embedding (times
        sqrt(size)) and the normalized projection of its embedding (times hidden^-0.5),
        averaged with weight 2^-0.5 each."""
        size = self.config.per_layer_input_size
        if not size:
            return None
        shape = (input_ids.shape[0], self.config.num_hidden_layers, size)
        own = self.embed_tokens_per_layer(input_ids) * torch.tensor(size**0.5, dtype=embeds.dtype)
        projected = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + own.view(shape).to(embeds.dtype)) * 2**-0.5

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | WeightPart]], device: torch.device | str | None = None
    ) -> None:
        """transformers' names, with the router under `moe`; a KV-shared layer's k/v
        projections and norms, which some checkpoints keep though no layer reads them, skipped."""
        shared = {f"layers.{layer}.self_attn.{name}" for layer, _ in kv_cache_layout(self.config).shared for name in _SHARED_LAYER_TENSORS}

        def renamed() -> Iterable[tuple[str, torch.Tensor | WeightPart]]:
            for name, tensor in weights:
                for old, new in _RENAMED.items():
                    name = name.replace(old, new)
                if name.removeprefix("model.").rsplit(".", 1)[0] in shared:
                    continue
                yield name, tensor

        super().load_weights(renamed(), device)


def gemma4_rotary_tables(config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """The global layers' table (their head size; only the first global_rotated_share of
    the frequencies turn, the rest stay at angle 0) and the sliding layers' (float32)."""
    head_dim = config.global_head_dim or config.head_dim
    rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    turning = int(config.global_rotated_share * head_dim // 2)
    rotary.cos_cache[:, turning:] = 1.0
    rotary.sin_cache[:, turning:] = 0.0
    local = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.local_rope_theta or 10_000.0)
    return rotary.float(), local.float()
