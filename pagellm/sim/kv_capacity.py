"""Simulation stage: how many KV blocks an engine would get, without a device.

Mirrors the engine's sizing (pagellm/worker/cache_sizing.py), in the same order of
precedence: num_gpu_blocks_override, then kv_cache_memory_bytes, then the device budget.
On a GPU the budget is gpu_memory_utilization of the memory minus the weights, the peak
activations of the profiling forward, and a fixed runtime reserve; on the CPU it is the
engine's fixed default budget.

With tensor parallelism every figure is one GPU's: its share of the weights and of the
activations, and KV blocks holding only its KV heads (tensor_parallel.py). Every GPU of
the group holds the same block ids, so one GPU's block count is the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.errors import ConfigError
from pagellm.model.config import ModelConfig
from pagellm.sim.gpu_presets import GiB, GpuSpec
from pagellm.model.costs import ModelCosts
from pagellm.sim.tensor_parallel import MAX_TENSOR_PARALLEL_SIZE, rank_config, rank_costs, tp_split_error

# pagellm/worker/cache_sizing.py's DEFAULT_CPU_KV_CACHE_BYTES (that module imports torch;
# tests/sim checks the two agree). The engine also caps it at half the available RAM,
# a property of the machine it runs on, not of the one simulating it.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB
# CUDA context, cuBLAS/NCCL workspaces and CUDA graphs: memory the engine's profiling
# does not see as activations. An assumption (a few hundred MiB to ~1 GiB in practice).
GPU_RUNTIME_RESERVE_BYTES = 1 * GiB


@dataclass(frozen=True)
class KVCapacity:
    num_gpu_blocks: int  # including the reserved null block 0, as CacheConfig counts
    num_cpu_blocks: int  # host blocks for swap preemption
    kv_cache_bytes: int
    how: str  # how the size was decided, for the report


def activation_peak_bytes(
    config: ModelConfig,
    dtype_bytes: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tensor_parallel_size: int = 1,
) -> int:
    """Estimated peak activation memory of a forward at the full token budget: the
    widest intermediate tensors of one layer alive together (the gated MLP's 2 x
    intermediate output, the q/k/v projection, a few hidden-size buffers) plus float32
    logits for as many rows as can be sampled in one step.

    With tensor parallelism the layer's tensors are one GPU's share, but the logits are
    whole: they are gathered onto the first GPU, the one that runs out of memory first."""
    vocab_size = config.vocab_size
    config = rank_config(config, tensor_parallel_size)
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = 2 * config.intermediate_size + q + 2 * kv + 3 * config.hidden_size
    logits = min(max_num_seqs, max_num_batched_tokens) * vocab_size * 4
    return int(max_num_batched_tokens * per_token * dtype_bytes) + logits


def kv_capacity(
    *,
    costs: ModelCosts,
    block_size: int,
    gpu: GpuSpec | None,
    gpu_memory_utilization: float,
    activation_bytes: int,
    kv_cache_memory_bytes: int | None = None,
    num_gpu_blocks_override: int | None = None,
    swap_space_bytes: int = 0,
    tensor_parallel_size: int = 1,
) -> KVCapacity:
    """The KV cache an engine would size; gpu=None means the CPU's default budget.
    `costs` and `activation_bytes` are one GPU's (tensor_parallel_size only words the
    report)."""
    bytes_per_block = costs.kv_bytes_per_block(block_size)
    num_cpu_blocks = swap_space_bytes // bytes_per_block
    if num_gpu_blocks_override is not None:
        num = num_gpu_blocks_override
        how = "num_gpu_blocks_override"
    else:
        if kv_cache_memory_bytes is not None:
            budget, how = kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif gpu is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
            how = f"CPU default budget ({budget / GiB:.2f} GiB)"
        else:
            used = costs.weight_bytes + activation_bytes + GPU_RUNTIME_RESERVE_BYTES
            budget = int(gpu.memory_bytes * gpu_memory_utilization - used)
            how = (
                f"gpu_memory_utilization={gpu_memory_utilization} of {gpu.memory_gib:g} GiB "
                f"minus {costs.weight_bytes / GiB:.2f} GiB weights, "
                f"{activation_bytes / GiB:.2f} GiB activations, "
                f"{GPU_RUNTIME_RESERVE_BYTES / GiB:.2f} GiB runtime reserve"
            )
            if tensor_parallel_size > 1:
                how += f", on each of the TP={tensor_parallel_size} GPUs"
            if budget <= 0:
                raise ConfigError(
                    f"no memory left for the KV cache on {gpu.name}: weights "
                    f"({costs.weight_bytes / GiB:.1f} GiB) and activations take more than "
                    f"gpu_memory_utilization={gpu_memory_utilization} of "
                    f"{gpu.memory_gib:g} GiB"
                )
        # +1: block 0 is the reserved null block and holds no tokens.
        num = budget // bytes_per_block + 1
    if num < 2:
        raise ConfigError(
            f"the KV cache ({how}) is smaller than one block of {bytes_per_block} bytes"
        )
    return KVCapacity(num, num_cpu_blocks, (num - 1) * bytes_per_block, how)


def tp_sizes_that_fit(
    config: ModelConfig,
    dtype_bytes: float,
    gpu: GpuSpec,
    *,
    gpu_memory_utilization: float,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> list[int]:
    """The tensor-parallel sizes (up to one node) at which the model splits and each GPU
    has room for its weights, its activations and the KV of one max_model_len request."""
    sizes = []
    for tp in range(1, MAX_TENSOR_PARALLEL_SIZE + 1):
        if tp_split_error(config, tp) is not None:
            continue
        costs = rank_costs(config, dtype_bytes, tp)
        activations = activation_peak_bytes(
            config, dtype_bytes, max_num_batched_tokens, max_num_seqs, tp
        )
        used = costs.weight_bytes + activations + GPU_RUNTIME_RESERVE_BYTES
        budget = gpu.memory_bytes * gpu_memory_utilization - used
        if budget // costs.kv_bytes_per_block(block_size) >= -(-max_model_len // block_size):
            sizes.append(tp)
    return sizes
