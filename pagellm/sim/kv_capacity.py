"""Sim stage: the memory facts a simulated GPU would measure, estimated from its
preset, and so the KV cache an engine would size there without a device.

The sizing itself is the engine's (config/cache.py: the same precedence of
num_gpu_blocks_override, kv_cache_memory_bytes and the device budget). What the simulator
supplies is what a rank would have measured: the GPU's memory and its peak use besides
the KV cache, here the weights, the peak activations of the profiling forward and a fixed
runtime reserve. On a CPU target there is nothing to estimate: the engine's fixed default
budget, without the cap at half of the free RAM (a property of the machine the engine
runs on, not of the one simulating it).

With tensor parallelism every figure is one GPU's: its share of the weights and of the
activations, and KV blocks holding only its KV heads (config/parallel.py). Every GPU of
the group holds the same block ids, so one GPU's block count is the engine's.
"""

from __future__ import annotations

from pagellm.config.cache import CacheBudget, CacheSize, MemoryFacts, decide_cache_size, kv_bytes_per_block
from pagellm.config.model import ModelConfig
from pagellm.config.parallel import rank_model_config
from pagellm.config.units import GiB
from pagellm.model.costs import ModelCosts
from pagellm.sim.gpu_presets import GpuSpec

# CUDA context, cuBLAS/NCCL workspaces and CUDA graphs: memory the engine's profiling
# does not see as activations. An assumption (a few hundred MiB to ~1 GiB in practice).
GPU_RUNTIME_RESERVE_BYTES = 1 * GiB


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
    config = rank_model_config(config, tensor_parallel_size)
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token = 2 * config.intermediate_size + q + 2 * kv + 3 * config.hidden_size
    logits = min(max_num_seqs, max_num_batched_tokens) * vocab_size * 4
    return int(max_num_batched_tokens * per_token * dtype_bytes) + logits


def gpu_memory_facts(
    config: ModelConfig,
    dtype_bytes: float,
    gpu: GpuSpec,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tensor_parallel_size: int = 1,
) -> MemoryFacts:
    """What one GPU of the group would measure: its memory, and its weights' share, peak
    activations and runtime reserve as the use besides the KV cache."""
    weights = ModelCosts.from_config(rank_model_config(config, tensor_parallel_size), dtype_bytes).weight_bytes
    activations = activation_peak_bytes(config, dtype_bytes, max_num_batched_tokens, max_num_seqs, tensor_parallel_size)
    each = f", on each of the TP={tensor_parallel_size} GPUs" if tensor_parallel_size > 1 else ""
    return MemoryFacts(
        device_total_bytes=gpu.memory_bytes,
        used_bytes=int(weights + activations + GPU_RUNTIME_RESERVE_BYTES),
        used_how=(
            f"estimated peak use (weights {weights / GiB:.2f} + activations {activations / GiB:.2f} + "
            f"runtime reserve {GPU_RUNTIME_RESERVE_BYTES / GiB:.2f} GiB{each})"
        ),
        device_name=gpu.name,
    )


def simulated_cache_size(
    config: ModelConfig,
    kv_cache_dtype: str,
    budget: CacheBudget,
    memory: MemoryFacts,
    tensor_parallel_size: int = 1,
    states_per_seat: int = 0,
    max_seats: int = 0,
) -> CacheSize:
    """The engine's sizing (config/cache.py) of one GPU's share of the model; a hybrid's
    recurrent states (`states_per_seat`, a slot and its snapshot, for up to `max_seats`
    requests) come off the budget first, as in the engine's worker."""
    share = rank_model_config(config, tensor_parallel_size)
    return decide_cache_size(
        budget, kv_bytes_per_block(share, budget.block_size, kv_cache_dtype), memory,
        states_per_seat * share.state_bytes_per_request(), max_seats,
    )  # fmt: skip
