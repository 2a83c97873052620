"""Config stage: how a model may be split over tensor-parallel ranks, and the parallel settings.

One rule for the engine and the simulator (Megatron-style, as vLLM lays it out): query
heads split evenly; KV heads split evenly or, where there are fewer KV heads than ranks,
each is replicated on size / num_kv_heads ranks (every rank needs the K/V of its query
heads); the MLP's intermediate rows split evenly; the vocabulary is padded up to a
multiple of the size. model/tensor_parallel.py slices weights by it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagellm.config.model import ModelConfig
from pagellm.config.units import cdiv
from pagellm.errors import ConfigError

# Where the ranks of a tensor-parallel model run: processes on this machine, or Ray actors.
DISTRIBUTED_EXECUTOR_BACKENDS: tuple[str, ...] = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: mp
    num_threads_per_rank: int | None = None  # CPU ranks share the cores (None: torch's default)


def tp_split_error(config: ModelConfig, size: int) -> str | None:
    """Why `config` cannot be split over `size` ranks (None: it can)."""
    if size < 1:
        return f"tensor_parallel_size must be >= 1, got {size}"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        return f"num_attention_heads={heads} does not split over TP={size}"
    if kv_heads % size and size % kv_heads:
        return f"num_key_value_heads={kv_heads} neither splits over nor replicates across TP={size}"
    global_kv_heads = config.num_global_key_value_heads
    if global_kv_heads and global_kv_heads % size and size % global_kv_heads:
        return f"num_global_key_value_heads={global_kv_heads} neither splits over nor replicates across TP={size}"
    if config.intermediate_size % size:
        return f"intermediate_size={config.intermediate_size} does not split over TP={size}"
    if config.num_experts and config.expert_intermediate_size % size:
        return f"each expert's intermediate size {config.expert_intermediate_size} does not split over TP={size}"
    if config.shared_expert_intermediate_size % size:
        return f"the shared expert's intermediate size {config.shared_expert_intermediate_size} does not split over TP={size}"
    spec = config.linear_attention
    if spec is not None and spec.num_key_heads % size:  # each rank keeps whole key heads and their value heads
        return f"linear attention's {spec.num_key_heads} key heads do not split over TP={size}"
    return None


def valid_tp_sizes(config: ModelConfig, limit: int = 64) -> list[int]:
    """The degrees up to `limit` that split this model."""
    return [n for n in range(1, limit + 1) if tp_split_error(config, n) is None]


def check_tp_size(config: ModelConfig, size: int) -> None:
    """A degree the model cannot be split by is an error naming the ones that work."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    error = tp_split_error(config, size)
    if error is not None:
        raise ConfigError(
            f"tensor_parallel_size={size} does not split this model: {config.num_attention_heads} "
            f"attention heads, {config.num_key_value_heads} KV heads, intermediate size "
            f"{config.intermediate_size} ({error}); sizes that work: {valid_tp_sizes(config)}"
        )


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """An even share of the KV heads, or one replicated head when there are fewer than ranks."""
    return max(1, num_kv_heads // size)


def rank_model_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes each of `size` ranks builds its layers (and sizes its KV cache) with;
    the vocabulary is the padded per-rank share."""
    if size == 1:
        return config
    check_tp_size(config, size)
    spec = config.linear_attention
    return dataclasses.replace(
        config,
        linear_attention=None if spec is None else dataclasses.replace(
            spec, num_key_heads=spec.num_key_heads // size, num_value_heads=spec.num_value_heads // size
        ),
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=kv_heads_per_rank(config.num_key_value_heads, size),
        num_global_key_value_heads=(
            None if config.num_global_key_value_heads is None else kv_heads_per_rank(config.num_global_key_value_heads, size)
        ),
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=None if config.moe_intermediate_size is None else config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size,
        vocab_size=cdiv(config.vocab_size, size),
    )
