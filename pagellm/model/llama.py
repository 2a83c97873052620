"""Model stage: a Llama-family decoder over a flattened batch and a paged KV cache.

One forward takes the tokens of several requests at once (prefill chunks and single
decode tokens mixed, no padding) with their positions; attention reads and writes K/V
through the attention backend. Logits are computed only for the rows that need a next
token (`compute_logits` on selected hidden states).

Covers LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM: they differ only in
q/k/v biases, tied embeddings and rope settings, all carried by ModelConfig; other
families subclass it (model/registry.py maps architecture names to classes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.errors import InvalidRequestError, ModelLoadError
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.config.model import CLASSIFIER_ONLY, NO_CLASSIFIER, NO_LM_HEAD, ModelConfig
from pagellm.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from pagellm.kernels.linear_bindings import CpuLinearKernels
from pagellm.kernels.weights import PackedWeight, WeightPart, WeightType, check_part
from pagellm.kernels.linear_choice import LinearPlan
from pagellm.model.packable_layers import PackableEmbedding, PackableLinear, apply_linear
from pagellm.model.tensor_parallel import TPGroup, vocab_parallel_embed

if TYPE_CHECKING:
    from pagellm.kernels.linear_choice import LinearChoice
    from pagellm.model.linear_plans import LinearGroup


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, tp: TPGroup | None = None, layer: int = 0, kernel: CpuLinearKernels | None = None
    ) -> None:
        super().__init__()
        self.tp = tp  # o_proj is row-parallel: its partial sums are all-reduced
        self.sliding_window = config.layer_window(layer)
        self.kv_group = kv_cache_layout(config).group_of_layer(layer)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.softcap = config.attn_logit_softcapping
        # q, k and v projections fused into one matmul.
        self.qkv_proj = PackableLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, kernel=kernel
        )
        self.o_proj = PackableLinear(self.q_size, config.hidden_size, bias=config.attention_out_bias, kernel=kernel)
        # gpt-oss: each head's learned logit in its softmax's denominator (the backends read it).
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,  # rotary tables of this step's positions; None: NoPE
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.position_qk(q, k, cos_sin)
        group_metadata = metadata.for_group(self.kv_group)
        out = backend.forward(
            q, k, v, kv_cache, group_metadata, self.scale, self.sliding_window, self.softcap, self.sinks
        )
        projected = self.o_proj(out.reshape(num_tokens, self.q_size))
        return projected if self.tp is None else self.tp.all_reduce(projected)

    def position_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, heads, head_dim] each
        """q and k as attention reads them: rotated by their positions (a family may
        normalize them first)."""
        return apply_rotary(q, k, cos_sin)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup | None = None,
        intermediate_size: int | None = None,
        kernel: CpuLinearKernels | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp  # down_proj is row-parallel: its partial sums are all-reduced
        self.intermediate_size = intermediate_size or config.intermediate_size
        # gate and up projections fused into one matmul.
        self.gate_up_proj = PackableLinear(config.hidden_size, 2 * self.intermediate_size, bias=False, kernel=kernel)
        self.down_proj = PackableLinear(self.intermediate_size, config.hidden_size, bias=False, kernel=kernel)
        self.gelu = config.hidden_activation == "gelu_tanh"  # GeGLU (Gemma); else SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out = self.down_proj(activated * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup | None = None,
        attention_class: type[LlamaAttention] = LlamaAttention,
        mlp: nn.Module | None = None,
        layer: int = 0,
        kernel: CpuLinearKernels | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_class(config, tp, layer, kernel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp, kernel=kernel) if mlp is None else mlp

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            cos_sin, self.input_layernorm(hidden), kv_cache, metadata, backend
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# HF checkpoint names of the separate projections -> (fused parameter, shard index).
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """The whole model, or with `tp` one tensor-parallel rank's share of it: then `config`
    holds this rank's shapes (see TPLayout.local_config) and `vocab_size` the full one.

    A family that differs only inside attention (model/qwen3.py) subclasses this with its
    own `attention_class`. `forward` is the PyTorch layers (over the measured linear
    kernels on a bf16 CPU); the worker may run a step another way that computes the same
    layers (worker/step_paths/: the native CPU paths of model/native/ read this model)."""

    attention_class: type[LlamaAttention] = LlamaAttention
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_class: type[RMSNorm] = RMSNorm
    # HF names of separate projections -> (the fused parameter, its shard index).
    stacked_params: dict[str, tuple[str, int]] = _STACKED

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        rope_freq_divisors: torch.Tensor | None = None,
        tp: TPGroup | None = None,
        kernel: CpuLinearKernels | None = None,
    ) -> None:
        """kernel: the CPU linear kernels every linear layer runs on (bf16 on x86-64 with
        AVX2 or more; None: torch), each layer built with it."""
        super().__init__()
        self.config = config
        self.cpu_linear_kernels = kernel
        self.tp = tp
        self.vocab_size = config.vocab_size if tp is None else tp.layout.vocab_size
        self.backend = backend
        self.rotary, self.local_rotary = self.rotary_tables_for(config, rope_freq_divisors)
        self.embed_tokens = PackableEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(config, tp, self.attention_class, self.make_mlp(config, tp, i, kernel), i, kernel)
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings or not config.has_lm_head:
            self.lm_head = None
        else:
            self.lm_head = PackableLinear(config.hidden_size, config.vocab_size, bias=False, kernel=kernel)
        # A sequence classifier's head (HF's `score`): tiny, applied to pooled rows only, so a
        # plain linear outside the kernel plans; replicated on every tensor-parallel rank.
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False) if config.num_labels else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed(input_ids)
        cos_sin = self.rotary.lookup(positions, hidden.dtype)
        local_cos_sin = cos_sin if self.local_rotary is None else self.local_rotary.lookup(positions, hidden.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            layer_cos_sin = cos_sin if layer.self_attn.sliding_window is None else local_cos_sin
            if not self.config.layer_rotates(index):
                layer_cos_sin = None  # a NoPE layer (SmolLM3)
            hidden = layer(layer_cos_sin, hidden, kv_cache, metadata, self.backend)
        return self.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden_size]
        """The tokens' embeddings as the first layer reads them."""
        if self.tp is None:
            hidden = self.embed_tokens(input_ids)
        else:
            hidden = self.tp.all_reduce(vocab_parallel_embed(self.tp.layout, self.embed_tokens, input_ids))
        if self.config.embedding_multiplier != 1.0:
            # In the model's dtype, as the reference rounds it (sqrt(3072) is 55.5 in bf16).
            hidden = hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)
        return hidden

    # Set once by the after-load pass of a bf16 CPU model (model/native/after_load.py).
    lm_head_plan: LinearPlan | None = None  # the measured kernel choice of the LM head (float32 logits)
    linear_choice: LinearChoice | None = None  # every linear group's plan and timings (model/linear_plans.py)
    linear_groups: list[LinearGroup] | None = None

    @staticmethod
    def rotary_tables_for(
        config: ModelConfig, freq_divisors: torch.Tensor | None = None
    ) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        """The global layers' rotary table and the sliding layers' own, if any (a family
        whose layers turn otherwise has its own)."""
        return rotary_tables(config, freq_divisors)

    def make_mlp(self, config: ModelConfig, tp: TPGroup | None, layer: int, kernel: CpuLinearKernels | None = None) -> nn.Module:
        """Layer `layer`'s MLP (a family with experts returns its sparse block)."""
        return LlamaMLP(config, tp, kernel=kernel)

    def lm_head_module(self) -> PackableLinear | PackableEmbedding:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab_size]
        """Logits of the full vocabulary (with tensor parallelism: gathered from every rank,
        a collective call that every rank makes with the same rows). A bf16 model on the
        native kernels gets float32 logits: rounding them to bf16 (spacing 0.06-0.125 at
        typical logit sizes) would tie tokens float32 tells apart."""
        if not self.config.has_lm_head:
            raise InvalidRequestError(CLASSIFIER_ONLY if self.config.num_labels else NO_LM_HEAD, "model")
        head = self.lm_head_module()
        out_dtype = torch.float32 if self.cpu_linear_kernels is not None else None
        logits = apply_linear(
            hidden, head.weight, head.packed, None, self.cpu_linear_kernels, self.lm_head_plan, out_dtype
        )
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:  # [hidden_size] -> [num_labels] float32
        """A sequence classifier's logits of one pooled final hidden state (float32 product)."""
        if self.score is None:
            raise InvalidRequestError(NO_CLASSIFIER, "model")
        return torch.nn.functional.linear(pooled.float(), self.score.weight.float())

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | WeightPart]], device: torch.device | str | None = None
    ) -> None:
        """Load tensors named as in HF checkpoints (`model.layers.0.self_attn.q_proj.weight`).

        A tensor is a float tensor, or a `WeightPart` kept as stored (quantization blocks,
        int8 rows) for a linear layer or the embedding. Parameters still on the meta device
        (a model built without memory) are created on `device` as their tensors arrive.
        Every parameter must be provided exactly once; a missing or unexpected tensor is
        a ModelLoadError naming it.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fused_parts: dict[str, dict[int, torch.Tensor | WeightPart]] = {}
        for hf_name, tensor in weights:
            name = _local_name(hf_name)
            if name is None:
                continue
            parts = name.split(".")
            stacked = self.stacked_params.get(parts[-2]) if len(parts) >= 2 else None
            if stacked is not None:
                fused_name = ".".join(parts[:-2] + [stacked[0], parts[-1]])
                fused_parts.setdefault(fused_name, {})[stacked[1]] = tensor
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store the copy anyway
            if isinstance(tensor, WeightPart):
                self._use_packed(name, [tensor])
            else:
                self._copy_param(params, name, tensor, device)
            loaded.add(name)
        for fused_name, shards in fused_parts.items():
            fused = fused_name.split(".")[-2]
            expected = sum(1 for target, _ in self.stacked_params.values() if target == fused)
            if sorted(shards) != list(range(expected)):
                raise ModelLoadError(f"checkpoint is missing part of {fused_name}")
            ordered = [shards[i] for i in range(expected)]
            if any(isinstance(shard, WeightPart) for shard in ordered):
                self._use_packed(fused_name, [_as_part(shard) for shard in ordered])
            else:
                self._copy_param(params, fused_name, torch.cat(ordered, 0), device)
            loaded.add(fused_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}"
            )

    def _use_packed(self, name: str, parts: list[WeightPart]) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name) if module_name else None
        if attr != "weight" or not isinstance(module, (PackableLinear, PackableEmbedding)):
            raise ModelLoadError(f"tensor {name!r} cannot stay quantized (not a linear layer's weight)")
        if isinstance(module, PackableLinear):
            rows, k = module.out_features, module.in_features
        else:
            rows, k = module.num_embeddings, module.embedding_dim
        for part in parts:
            check_part(part, k, name)
        if sum(part.rows for part in parts) != rows:
            raise ModelLoadError(f"tensor {name!r} has {sum(p.rows for p in parts)} rows, expected {rows}")
        module.use_packed(PackedWeight(parts, k))

    def _copy_param(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, device: torch.device | str | None
    ) -> None:
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        if param.is_meta:
            module_name, _, attr = name.rpartition(".")
            owner = self.get_submodule(module_name) if module_name else self
            value = tensor.to(dtype=param.dtype, device=device or "cpu").contiguous()
            setattr(owner, attr, nn.Parameter(value, requires_grad=False))
        else:
            param.copy_(tensor.to(dtype=param.dtype, device=param.device))

    def weight_bytes_by_format(self) -> dict[str, int]:
        """Resident bytes of the weights by how they are held (bf16, Q4_1 as stored, ...)."""
        totals: dict[str, int] = {}
        for module in self.modules():
            packed = getattr(module, "packed", None)
            if packed is not None:
                for part in packed.parts:
                    key = {WeightType.BF16: "bfloat16", WeightType.I8_ROW: "int8"}.get(part.type, f"{part.type.label} as stored")
                    totals[key] = totals.get(key, 0) + part.nbytes
            for param in module.parameters(recurse=False):
                key = str(param.dtype).removeprefix("torch.")
                totals[key] = totals.get(key, 0) + param.numel() * param.element_size()
        return totals


def rotary_tables(
    config: ModelConfig, freq_divisors: torch.Tensor | None = None
) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The rotary table of the layers, and the sliding layers' own where their base differs
    (Gemma 3), float32 whatever the model dtype."""
    rotary = RotaryEmbedding.for_model(config, freq_divisors).float()
    if config.local_rope_theta is None:
        return rotary, None
    local = RotaryEmbedding(
        config.head_dim, config.max_position_embeddings, config.local_rope_theta, None, None, config.rotary_dim
    )
    return rotary, local.float()


def _as_part(shard: torch.Tensor | WeightPart) -> WeightPart:
    """One shard of a fused layer whose other shards stay quantized: bf16 rows."""
    if isinstance(shard, WeightPart):
        return shard
    return WeightPart(WeightType.BF16, shard.to(torch.bfloat16).contiguous())


def _local_name(hf_name: str) -> str | None:
    """Our parameter name for an HF tensor name, or None for tensors we do not keep."""
    if "rotary_emb.inv_freq" in hf_name:
        return None
    if hf_name.startswith("model."):
        return hf_name[len("model.") :]
    return hf_name
