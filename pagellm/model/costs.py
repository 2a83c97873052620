"""Model stage: the FLOPs and bytes of one step of a Llama-family model.

Counted as the roofline cost model (sim/roofline.py) and the engine's live MFU / MBU
(metrics/utilization.py) both need them: weight matmuls per computed token, attention
per (query, key) pair, the LM head per sampled row, and the bytes of the weights (read
once per step, whatever the batch) and of the KV cache per token.
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

    @classmethod
    def from_config(
        cls, config: ModelConfig, dtype_bytes: float, kv_dtype_bytes: float | None = None
    ) -> ModelCosts:
        h = config.hidden_size
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        layers = config.num_hidden_layers
        # 2 FLOPs (multiply + add) per weight per token.
        linear_params = layers * (h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size)
        head_params = config.vocab_size * h
        kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        return cls(
            linear_flops_per_token=2.0 * linear_params,
            linear_weight_bytes=float(linear_params * dtype_bytes),
            lm_head_flops_per_row=2.0 * head_params,
            lm_head_weight_bytes=float(head_params * dtype_bytes),
            # Scores (q . k) and the weighted sum of values: 2 MACs per head dimension.
            attention_flops_per_pair=4.0 * layers * config.num_attention_heads * config.head_dim,
            kv_bytes_per_token=2.0 * layers * kv * kv_bytes,
            weight_bytes=float(config.num_parameters() * dtype_bytes),
        )

    @property
    def step_weight_bytes(self) -> float:
        """Weights a forward pass reads (the projections and the LM head; embedding rows
        are looked up, not streamed)."""
        return self.linear_weight_bytes + self.lm_head_weight_bytes

    def kv_bytes_per_block(self, block_size: int) -> int:
        return int(self.kv_bytes_per_token * block_size)
