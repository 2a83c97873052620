"""Config stage: which checkpoint runs, and its architecture's shapes and numerics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagellm.errors import UnsupportedModelError


@dataclass(frozen=True)
class ModelSource:
    """A resolved checkpoint: a GGUF file or an HF checkpoint folder (or, in the
    simulator, a preset: shapes without weights)."""

    format: str  # "gguf" | "hf" | "preset"
    path: Path
    name: str  # what the user calls it (served model name by default)


ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope")
HIDDEN_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequency scaling: "linear", Llama 3's "llama3", "yarn" or Phi-3's "longrope"."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: with mscale_all_dim, the attention factor (DeepSeek style)
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None: from factor (0.1 ln(factor) + 1)
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    short_factor: tuple[float, ...] | None = None  # longrope: per-frequency divisors inside the original context
    long_factor: tuple[float, ...] | None = None  # longrope: ... beyond it

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported "
                f"(supported: none/default, {', '.join(repr(t) for t in ROPE_SCALING_TYPES)})."
            )
        if self.factor <= 0:
            raise UnsupportedModelError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type == "longrope" and (not self.short_factor or not self.long_factor):
            raise UnsupportedModelError("longrope rope scaling needs short_factor and long_factor lists")


# What a generation request on a model without an LM head is told.
NO_LM_HEAD = (
    "this model's checkpoint has no LM head (a base model saved for embeddings): it computes embeddings "
    "(LLM.embed, POST /v1/embeddings), not text"
)
# ... and on a sequence classifier (a cross-encoder reranker).
CLASSIFIER_ONLY = (
    "this model is a sequence classifier (its checkpoint has a classification head, no LM head): it scores "
    "(LLM.score, POST /v1/score, POST /v1/rerank), it does not generate text"
)
# What a classification request on a model without such a head is told.
NO_CLASSIFIER = (
    "this model has no classification head (a *ForSequenceClassification checkpoint has one); "
    "it scores pairs by the cosine similarity of their embeddings instead"
)


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The linear-attention layers of a hybrid model (Qwen3.5's Gated DeltaNet): which
    layers they are and their shapes. Such a layer keeps no KV cache: each request holds a
    fixed-size state per layer, the last conv_kernel_size - 1 inputs of its short
    convolution and a key x value matrix per value head."""

    layers: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4
    # Which q/k head each value head reads. HF's checkpoints group them (value head i reads
    # key head i // (value heads per key head)); llama.cpp's qwen35 converter reorders the
    # value heads so they tile instead (value head i reads key head i % key heads), and the
    # file's value-side tensors stay in that order.
    value_heads_tiled: bool = False

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise UnsupportedModelError(
                f"linear attention: value heads ({self.num_value_heads}) must be a multiple of "
                f"key heads ({self.num_key_heads})"
            )
        if self.conv_kernel_size < 1:
            raise UnsupportedModelError(f"linear attention: conv kernel size must be at least 1, got {self.conv_kernel_size}")

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def state_elements_per_layer(self) -> int:
        """Elements of one request's state in one layer (conv inputs + the recurrent matrices)."""
        conv = self.conv_dim * (self.conv_kernel_size - 1)
        return conv + self.num_value_heads * self.key_head_dim * self.value_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder, independent of the file format."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama with attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama with attention_bias)
    # Sliding-window attention: a query at position p sees keys p - sliding_window + 1 ..
    # p, in the layers named by sliding_window_layers (None: every layer, as Mistral).
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    # The sliding layers' rotary base, unscaled (Gemma 3: 10000 where the global layers
    # turn at 1e6 with linear scaling); None: every layer turns as rope_theta/rope_scaling say.
    local_rope_theta: float | None = None
    hidden_activation: str = "silu"  # the MLP gate's: "silu" or "gelu_tanh" (GeGLU, Gemma)
    embedding_multiplier: float = 1.0  # token embeddings are scaled by this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    # Soft-capping, x -> cap * tanh(x / cap) (Gemma 2): of the attention scores, of the logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that rotary turns (Phi-4-mini)
    # Mixture of experts (Mixtral, Qwen3-MoE); 0 experts: every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # each expert's; None: intermediate_size (Mixtral)
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP (Qwen3-MoE mlp_only_layers)
    # Qwen2-MoE: a dense expert every row also takes, scaled by sigmoid(a gate); 0: none.
    shared_expert_intermediate_size: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Embeddings: how a prompt's hidden states pool into one vector ("last", "mean", "cls";
    # a sentence-transformers folder's 1_Pooling/config.json, a GGUF's pooling_type), and
    # whether the model was trained to have its embeddings shortened (Matryoshka).
    pooling_type: str = "last"
    # False: the checkpoint has no LM head (a base model saved for embeddings, untied): it
    # computes embeddings, never text.
    has_lm_head: bool = True
    # A sequence-classification checkpoint (LlamaForSequenceClassification, ...): the rows of
    # its `score` head over the last token's final hidden state (cross-encoder rerankers have
    # one); 0: no head.
    num_labels: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # A hybrid (Qwen3.5): the layers that run linear attention instead of attention, and
    # their shapes; None: every layer attends.
    linear_attention: LinearAttentionSpec | None = None
    # Attention's output is gated per element by sigmoid(a second half of q_proj) (Qwen3.5).
    attention_output_gate: bool = False
    # RMSNorm weights are stored as offsets from 1 (x * (1 + w): Gemma, Qwen3.5).
    norm_weight_offset: bool = False
    # Layers whose attention has no rotary embedding at all (SmolLM3's NoPE layers: q and k
    # reach attention as projected).
    nope_layers: tuple[int, ...] = ()
    # gpt-oss: a learned logit per attention head that joins its softmax's denominator
    # (attention sinks); biases on the router and on every expert's projections; the
    # experts' clamped SwiGLU, (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit) (None: the plain SwiGLU); the router's top-k taken from its
    # logits, then a softmax over those k (else a softmax over all, then the top-k).
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    softmax_after_topk: bool = False
    # The experts' weights as the checkpoint stores them, in bits per weight (gpt-oss: MXFP4,
    # 4.25); None: the model's dtype. What the cost model counts for them.
    expert_bits_per_weight: float | None = None
    # Gemma 4. Its full-attention layers have heads of their own size and count
    # (global_head_dim, num_global_key_value_heads; None: as the sliding ones), their keys
    # serve as values too (attention_k_eq_v: no v projection), and their rotary turns only
    # the first global_rotated_share of each head's frequencies ("proportional" rope: the
    # others have frequency 0, their dimension pairs pass unchanged). The last
    # num_kv_shared_layers layers compute no K/V: each reads the K/V of the last earlier layer
    # of its kind (sliding or full), and holds no KV cache of its own; with
    # double_wide_shared_mlp their MLPs are twice intermediate_size. Every layer may add a
    # per-layer input (per_layer_input_size wide, its own embedding of
    # per_layer_input_vocab_size rows per layer; 0: none), and v is RMS-normalized without a
    # scale (value_norm). experts_beside_mlp: the experts' block runs beside the dense MLP.
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    global_rotated_share: float = 1.0
    num_kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_input_vocab_size: int = 0
    value_norm: bool = False
    experts_beside_mlp: bool = False

    def __post_init__(self) -> None:
        if self.hidden_activation not in HIDDEN_ACTIVATIONS:
            raise UnsupportedModelError(
                f"MLP activation {self.hidden_activation!r} is not supported (supported: {', '.join(HIDDEN_ACTIVATIONS)})"
            )
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "attention_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UnsupportedModelError(f"{name} must be positive, got {value}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and num_experts ({self.num_experts})."
            )
        for layer in self.attention_layers:
            if self.num_attention_heads % self.layer_kv_heads(layer) != 0:
                raise UnsupportedModelError(
                    f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"the KV heads ({self.layer_kv_heads(layer)}) of layer {layer}."
                )
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise UnsupportedModelError(
                f"num_kv_shared_layers ({self.num_kv_shared_layers}) must be below the layer count ({self.num_hidden_layers})"
            )
        for layer in range(self.num_hidden_layers - self.num_kv_shared_layers, self.num_hidden_layers):
            self.kv_owner(layer)  # raises where no earlier layer of its kind computes K/V

    def describe(self) -> str:
        """The startup report's architecture line, e.g. `Qwen3MoeForCausalLM: 48 layers;
        attention: 48 global, 32 query / 4 KV heads of 128, q/k norms; experts: 128, 8 per
        token, 768 wide, in 48 layers`."""
        num_local = sum(self.layer_window(layer) is not None for layer in self.attention_layers)
        num_global = len(self.attention_layers) - num_local
        attention = f"{num_global} global"
        if num_local:
            attention = f"{num_local} local (window {self.sliding_window})" + (f" : {num_global} global" if num_global else "")
        parts = [
            f"{self.architecture}: {self.num_hidden_layers} layers",
            f"attention: {attention}, {self.num_attention_heads} query / {self.num_key_value_heads} KV heads "
            f"of {self.head_dim}" + (", q/k norms" if self.qk_norm else "")
            + (f", rotary on {self.rotary_dim} of {self.head_dim} dims" if self.rotary_dim != self.head_dim else ""),
        ]  # fmt: skip
        if self.attention_output_gate:
            parts[-1] += ", output gate"
        if self.attention_sinks:
            parts[-1] += ", sinks"
        if self.nope_layers:
            parts[-1] += f", no rotary in {len(self.nope_layers)} layers"
        if self.global_head_dim is not None or self.num_global_key_value_heads is not None:
            parts[-1] += (
                f", global layers {self.num_attention_heads} query / {self.layer_kv_heads(self.num_hidden_layers - 1)} "
                f"KV heads of {self.global_head_dim or self.head_dim}" + (" (k = v)" if self.attention_k_eq_v else "")
            )
        if self.num_kv_shared_layers:
            parts[-1] += f", the last {self.num_kv_shared_layers} layers reuse earlier layers' K/V"
        if self.per_layer_input_size:
            parts.append(f"per-layer inputs: {self.per_layer_input_size} wide")
        spec = self.linear_attention
        if spec is not None:
            parts.append(
                f"linear attention (gated delta rule): {len(spec.layers)} layers, {spec.num_key_heads} key / "
                f"{spec.num_value_heads} value heads of {spec.key_head_dim} / {spec.value_head_dim}, "
                f"conv {spec.conv_kernel_size}"
            )
        if self.rope_scaling is not None:
            parts.append(f"rotary scaling: {self.rope_scaling.rope_type} x{self.rope_scaling.factor:g}")
        if self.local_rope_theta is not None:
            parts.append(f"rotary base {self.rope_theta:g} global, {self.local_rope_theta:g} local")
        caps = [f"{kind} {cap:g}" for kind, cap in (("attention", self.attn_logit_softcapping),
                                                    ("logits", self.final_logit_softcapping)) if cap]  # fmt: skip
        if caps:
            parts.append("soft caps: " + ", ".join(caps))
        if self.num_experts:
            sparse = sum(self.is_sparse_layer(layer) for layer in range(self.num_hidden_layers))
            parts.append(
                f"experts: {self.num_experts}, {self.num_experts_per_tok} per token, "
                f"{self.expert_intermediate_size} wide, in {sparse} layers"
                + (f", a shared one {self.shared_expert_intermediate_size} wide" if self.shared_expert_intermediate_size else "")
                + (f", clamped SwiGLU (limit {self.swiglu_limit:g}, alpha {self.swiglu_alpha:g})" if self.swiglu_limit else "")
            )
        if self.num_labels:
            parts.append(f"classification head: {self.num_labels} label(s), no LM head (scores only)")
        elif not self.has_lm_head:
            parts.append("no LM head (embeddings only)")
        return "; ".join(parts)

    def is_linear_attention_layer(self, layer: int) -> bool:
        return self.linear_attention is not None and layer in self.linear_attention.layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and keep K/V in the paged cache)."""
        return tuple(layer for layer in range(self.num_hidden_layers) if not self.is_linear_attention_layer(layer))

    def state_bytes_per_request(self) -> int:
        """Bytes of one request's recurrent state over every linear-attention layer (float32:
        the state accumulates over the whole context, so it is kept at full precision)."""
        spec = self.linear_attention
        return 0 if spec is None else 4 * len(spec.layers) * spec.state_elements_per_layer()

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention (None: it sees the whole context)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    def is_global_layer(self, layer: int) -> bool:
        return self.layer_window(layer) is None

    def layer_head_dim(self, layer: int) -> int:
        """The head size of layer `layer`'s attention (Gemma 4: its global layers' own)."""
        if self.global_head_dim is not None and self.is_global_layer(layer):
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        if self.num_global_key_value_heads is not None and self.is_global_layer(layer):
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def layer_kv_width(self, layer: int) -> int:
        """Elements of one token's K (or V) in layer `layer`."""
        return self.layer_kv_heads(layer) * self.layer_head_dim(layer)

    def layer_has_value_projection(self, layer: int) -> bool:
        return not (self.attention_k_eq_v and self.is_global_layer(layer))

    def kv_owner(self, layer: int) -> int:
        """The layer whose K/V layer `layer` attends over: itself, or for a KV-shared layer
        (Gemma 4's last num_kv_shared_layers) the last earlier layer of its kind that computes K/V."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return layer
        window = self.layer_window(layer)
        for owner in range(first_shared - 1, -1, -1):
            if not self.is_linear_attention_layer(owner) and self.layer_window(owner) == window:
                return owner
        raise UnsupportedModelError(f"layer {layer} shares K/V, but no earlier layer of its kind computes them")

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The attending layers that compute and keep K/V (all but the KV-shared ones)."""
        return tuple(layer for layer in self.attention_layers if self.kv_owner(layer) == layer)

    def mlp_intermediate_size(self, layer: int) -> int:
        """The dense MLP's width in layer `layer` (Gemma 4's KV-shared layers: twice, with double_wide_shared_mlp)."""
        if self.double_wide_shared_mlp and self.kv_owner(layer) != layer:
            return 2 * self.intermediate_size
        return self.intermediate_size

    def layer_rotates(self, layer: int) -> bool:
        """Whether layer `layer` turns q and k by their positions (not a NoPE layer)."""
        return layer not in self.nope_layers

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def num_parameters(self) -> int:
        """Parameter count, used for FLOP estimates and logging."""
        h, v = self.hidden_size, self.vocab_size
        spec = self.linear_attention
        linear_attention = 0
        if spec is not None:
            value = spec.num_value_heads * spec.value_head_dim
            linear_attention = (
                h * (spec.conv_dim + value + 2 * spec.num_value_heads) + spec.conv_dim * spec.conv_kernel_size
                + value * h + 2 * spec.num_value_heads + spec.value_head_dim + 2 * h
            )  # fmt: skip
        total = 0
        for layer in range(self.num_hidden_layers):
            if self.is_linear_attention_layer(layer):
                total += linear_attention
            else:
                head_dim = self.layer_head_dim(layer)
                norms = 2 * h + (2 * head_dim if self.qk_norm else 0)
                total += self.attention_projection_parameters(layer) + norms
            if self.is_sparse_layer(layer):  # every expert and the router (and a shared expert with its gate)
                total += self.num_experts * 3 * h * self.expert_intermediate_size + self.num_experts * h
                total += (3 * h * self.shared_expert_intermediate_size + h) if self.shared_expert_intermediate_size else 0
            if not self.is_sparse_layer(layer) or self.experts_beside_mlp:
                total += 3 * h * self.mlp_intermediate_size(layer)
            total += 2 * h * self.per_layer_input_size
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        per_layer_inputs = self.num_hidden_layers * self.per_layer_input_size * (self.per_layer_input_vocab_size + h)
        return total + embed + h + per_layer_inputs

    def attention_projection_parameters(self, layer: int) -> int:
        """Weights of attending layer `layer`'s q, k, v (and gate) and o projections: a
        KV-shared layer has no k or v, a k = v layer no v."""
        h = self.hidden_size
        q = self.num_attention_heads * self.layer_head_dim(layer)
        gate = q if self.attention_output_gate else 0
        kv = 0
        if self.kv_owner(layer) == layer:
            kv = self.layer_kv_width(layer) * (2 if self.layer_has_value_projection(layer) else 1)
        return h * (q + gate + kv) + q * h
