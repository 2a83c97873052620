"""Benchmarks: the machine's measured matmul ceiling and the model's FLOPs per step."""

from __future__ import annotations

import time

import torch

from pagellm.model.config import ModelConfig


def measure_matmul_ceiling(dtype: torch.dtype = torch.float32, seconds: float = 1.5, size: int = 2048) -> float:
    """Best GFLOP/s of large square matmuls in `dtype` on this machine (CPU)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * size**3 / elapsed / 1e9)
    return best


def matmul_flops_per_token(config: ModelConfig) -> float:
    """FLOPs of the weight matmuls for one computed token (LM head excluded)."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return 2.0 * config.num_hidden_layers * per_layer


def workload_flops(config: ModelConfig, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Matmul FLOPs to serve a workload once (no recomputation): every prompt token and
    every fed-back output token through the layers, attention scores and values over the
    context, and the LM head once per generated token."""
    per_token = matmul_flops_per_token(config)
    attention_per_pair = 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    head = 2.0 * config.hidden_size * config.vocab_size
    total = 0.0
    for prompt, output in zip(prompt_lens, output_lens, strict=True):
        computed = prompt + output - 1
        total += computed * per_token
        # Token at position p attends to p + 1 positions.
        total += attention_per_pair * computed * (computed + 1) / 2
        total += output * head
    return total
