"""Bench stage: the machine's measured matmul ceiling and the model's FLOPs per workload.

The per-token and per-pair FLOP counts are the engine's own (model/costs.py),
so benchmark GFLOP/s and the engine's live MFU count the same work.
"""

from __future__ import annotations

from pagellm.metrics.ceilings import measure_matmul_ceiling, model_matmul_ceiling
from pagellm.model.costs import ModelCosts
from pagellm.config.model import ModelConfig

__all__ = ["measure_matmul_ceiling", "model_matmul_ceiling", "matmul_flops_per_token", "workload_flops"]


def matmul_flops_per_token(config: ModelConfig) -> float:
    """FLOPs of the weight matmuls for one computed token (LM head excluded)."""
    return ModelCosts.from_config(config, dtype_bytes=2).linear_flops_per_token


def workload_flops(config: ModelConfig, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Matmul FLOPs to serve a workload once (no recomputation): every prompt token and
    every fed-back output token through the layers, attention scores and values over the
    context, and the LM head once per generated token."""
    cost = ModelCosts.from_config(config, dtype_bytes=2)
    total = 0.0
    for prompt, output in zip(prompt_lens, output_lens, strict=True):
        computed = prompt + output - 1
        total += computed * cost.linear_flops_per_token
        # Token at position p attends to p + 1 positions.
        total += cost.attention_flops_per_pair * computed * (computed + 1) / 2
        total += output * cost.lm_head_flops_per_row
    return total
