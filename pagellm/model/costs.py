"""Model stage: the FLOPs and bytes of one step of a Llama-family model (with or without
experts, or a hybrid with linear-attention layers).

Counted as the roofline cost model (sim/roofline.py) and the engine's live MFU / MBU
(metrics/utilization.py) both need them: weight matmuls per computed token, attention
per (query, key) pair, the LM head per sampled row, and the bytes of the weights (read
once per step, whatever the batch) and of the KV cache per token. A hybrid's attention
and KV cache are its attending layers'; its linear-attention layers add the gated delta
rule and the short convolution per token, and read and write each request's recurrent
state once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.config.model import ModelConfig


@dataclass(frozen=True)
class ModelCosts:
    linear_flops_per_token: float  # q/k/v/o projections and the gated MLP, all layers
    linear_weight_bytes: float  # those matrices
    lm_head_flops_per_row: float  # one row of logits
    lm_head_weight_bytes: float  # the output matrix (the embedding when tied)
    attention_flops_per_pair: float  # QK^T and PV for one (query, key) pair, all layers
    kv_bytes_per_token: float  # K and V of one token, all layers
    weight_bytes: float  # every parameter (what the device must hold)
    # Mixture of experts: every expert's bytes (part of linear_weight_bytes), and the share
    # of a layer's experts one token uses (top_k / num_experts); 0 for a dense model.
    expert_weight_bytes: float = 0.0
    expert_share_per_token: float = 0.0
    # The layers' attention spans: (window, share of the layers); None is the whole context.
    # Attention pairs and KV reads of a sliding layer stop at its window.
    layer_windows: tuple[tuple[int | None, float], ...] = ((None, 1.0),)
    # A hybrid's linear-attention layers: the recurrence and convolution per computed token
    # (the projections are in linear_flops_per_token), and one request's float32 state,
    # which a step reads and writes for every request it computes.
    recurrent_flops_per_token: float = 0.0
    state_bytes_per_request: float = 0.0

    @classmethod
    def from_config(
        cls, config: ModelConfig, dtype_bytes: float, kv_dtype_bytes: float | None = None
    ) -> ModelCosts:
        h = config.hidden_size
        layers = config.num_hidden_layers
        attending = config.attention_layers
        # 2 FLOPs (multiply + add) per weight per token: a mixture of experts computes with
        # its router and the top_k experts a token is sent to, and holds all of them.
        sparse = sum(config.is_sparse_layer(layer) for layer in range(layers))
        attention_params = sum(config.attention_projection_parameters(layer) for layer in attending)
        recurrent_flops = 0.0
        spec = config.linear_attention
        if spec is not None:  # the Gated DeltaNets' input and output projections
            value = spec.num_value_heads * spec.value_head_dim
            attention_params += len(spec.layers) * (h * (spec.conv_dim + value + 2 * spec.num_value_heads) + value * h)
            # Per token and value head: decay, read (k S), write (k outer delta) and query
            # (q S) of the key x value state, ~7 FLOPs per element; the depthwise conv.
            per_token = 7 * spec.num_value_heads * spec.key_head_dim * spec.value_head_dim
            recurrent_flops = len(spec.layers) * (per_token + 2 * spec.conv_kernel_size * spec.conv_dim)
        # A shared expert (Qwen2-MoE) and its gate run for every token: dense weights.
        shared_params = sparse * (3 * h * config.shared_expert_intermediate_size + h) if config.shared_expert_intermediate_size else 0
        dense_mlp_params = shared_params + sum(
            3 * h * config.mlp_intermediate_size(layer)
            for layer in range(layers) if not config.is_sparse_layer(layer) or config.experts_beside_mlp
        )  # fmt: skip
        # Gemma 4's per-layer inputs: a projection of the embeddings and each layer's gate and projection.
        dense_mlp_params += layers * config.per_layer_input_size * 3 * h
        expert_params = sparse * config.num_experts * 3 * h * config.expert_intermediate_size
        active_expert_params = sparse * (config.num_experts_per_tok * 3 * h * config.expert_intermediate_size
                                         + config.num_experts * h)  # fmt: skip
        linear_params = attention_params + dense_mlp_params + expert_params + sparse * config.num_experts * h
        head_params = config.vocab_size * h
        kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        # Experts held as stored (gpt-oss's MXFP4): their own bytes per weight.
        expert_bytes = dtype_bytes if config.expert_bits_per_weight is None else config.expert_bits_per_weight / 8
        windows: dict[int | None, int] = {}
        for layer in attending:
            windows[config.layer_window(layer)] = windows.get(config.layer_window(layer), 0) + 1
        return cls(
            linear_flops_per_token=2.0 * (attention_params + dense_mlp_params + active_expert_params),
            linear_weight_bytes=float((linear_params - expert_params) * dtype_bytes + expert_params * expert_bytes),
            lm_head_flops_per_row=2.0 * head_params,
            lm_head_weight_bytes=float(head_params * dtype_bytes),
            # Scores (q . k) and the weighted sum of values: 2 MACs per head dimension.
            attention_flops_per_pair=4.0 * config.num_attention_heads * sum(config.layer_head_dim(layer) for layer in attending),
            kv_bytes_per_token=2.0 * sum(config.layer_kv_width(layer) for layer in config.kv_layers) * kv_bytes,
            weight_bytes=float((config.num_parameters() - expert_params) * dtype_bytes + expert_params * expert_bytes),
            expert_weight_bytes=float(expert_params * expert_bytes),
            expert_share_per_token=config.num_experts_per_tok / config.num_experts if config.num_experts else 0.0,
            layer_windows=tuple((window, count / len(attending)) for window, count in windows.items()) or ((None, 1.0),),
            recurrent_flops_per_token=float(recurrent_flops),
            state_bytes_per_request=float(config.state_bytes_per_request()),
        )

    def linear_bytes_read(self, num_tokens: int) -> float:
        """The projections' bytes a step of `num_tokens` reads: every dense matrix, and of
        the experts the expected share that at least one token is routed to (uniform
        routing: 1 - (1 - top_k/experts)^tokens; one token reads only its top_k)."""
        if not self.expert_weight_bytes:
            return self.linear_weight_bytes
        untouched = (1.0 - self.expert_share_per_token) ** max(num_tokens, 1)
        return self.linear_weight_bytes - self.expert_weight_bytes * untouched

    @property
    def step_weight_bytes(self) -> float:
        """Weights a forward pass of many tokens reads (the projections, every expert, and
        the LM head; embedding rows are looked up, not streamed)."""
        return self.linear_weight_bytes + self.lm_head_weight_bytes

    def step_weight_bytes_for(self, num_tokens: int) -> float:
        """Weights a forward pass of `num_tokens` tokens reads."""
        return self.linear_bytes_read(num_tokens) + self.lm_head_weight_bytes

    def kv_bytes_per_block(self, block_size: int) -> int:
        return int(self.kv_bytes_per_token * block_size)
