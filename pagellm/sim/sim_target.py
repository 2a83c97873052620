"""Simulation stage: what is simulated (a model on a device, with its step cost model)
and the engine configuration that device would give a set of engine arguments.

Engine arguments are pagellm's own EngineArgs (vLLM's names and defaults); they resolve
into the SchedulerConfig and CacheConfig the real engine would build, with the KV cache
sized from the device memory instead of by profiling a real device.

A target may be a tensor-parallel group: its cost model and its KV cache are then one
GPU's of the group (tensor_parallel.py). Data parallelism is not a property of the
target but of how many of them serve the workload (replicas.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.engine.arg_utils import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from pagellm.errors import ConfigError
from pagellm.model.config import ModelConfig
from pagellm.sim.calibrated import CalibratedCostModel
from pagellm.sim.cost_model import StepCostModel
from pagellm.sim.gpu_presets import GiB, GpuSpec
from pagellm.sim.kv_capacity import KVCapacity, activation_peak_bytes, kv_capacity, tp_sizes_that_fit
from pagellm.model.costs import ModelCosts
from pagellm.sim.model_presets import MODEL_PRESETS, get_model_preset
from pagellm.sim.roofline import RooflineCostModel, RooflineParams
from pagellm.sim.tensor_parallel import (
    MAX_TENSOR_PARALLEL_SIZE,
    TensorParallelComm,
    TensorParallelLink,
    rank_costs,
)


@dataclass(frozen=True)
class SimTarget:
    model_name: str
    model_config: ModelConfig
    dtype_bytes: int
    costs: ModelCosts  # one GPU's (its share of the model under tensor parallelism)
    cost_model: StepCostModel
    gpu: GpuSpec | None  # None: a CPU, whose KV budget is the engine's fixed default
    tensor_parallel: TensorParallelLink | None = None  # None: one GPU

    @property
    def device_name(self) -> str:
        return self.gpu.name if self.gpu is not None else "CPU"

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.tensor_parallel_size


def resolve_model(name_or_path: str) -> tuple[str, ModelConfig, int]:
    """(name, shape, bytes per weight) of a preset name, or of a checkpoint's config
    (GGUF file or HF folder; read as bfloat16, as the GPU engine runs it)."""
    if name_or_path.lower() in (name.lower() for name in MODEL_PRESETS):
        preset = get_model_preset(name_or_path)
        return preset.name, preset.config, preset.dtype_bytes
    if not Path(name_or_path).expanduser().exists():
        raise ConfigError(
            f"--model {name_or_path!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
            "nor an existing GGUF file or HF checkpoint folder"
        )
    from pagellm.model.loader import load_model_config, resolve_model_source  # imports torch

    source = resolve_model_source(name_or_path)
    return source.name, load_model_config(source), 2


def roofline_target(
    model: str, gpu: GpuSpec, params: RooflineParams, tensor_parallel: TensorParallelLink | None = None
) -> SimTarget:
    """The model on one GPU, or split over a tensor-parallel group of them (a group of
    one is the single GPU: the same costs and no collectives)."""
    name, config, dtype_bytes = resolve_model(model)
    if tensor_parallel is not None and tensor_parallel.tensor_parallel_size == 1:
        tensor_parallel = None
    if tensor_parallel is None:
        costs = ModelCosts.from_config(config, dtype_bytes)
        return SimTarget(name, config, dtype_bytes, costs, RooflineCostModel(name, costs, gpu, params), gpu)
    costs = rank_costs(config, dtype_bytes, tensor_parallel.tensor_parallel_size)
    comm = TensorParallelComm(config, dtype_bytes, tensor_parallel)
    cost_model = RooflineCostModel(name, costs, gpu, params, comm)
    return SimTarget(name, config, dtype_bytes, costs, cost_model, gpu, tensor_parallel)


def calibrated_target(model: CalibratedCostModel) -> SimTarget:
    costs = ModelCosts.from_config(model.model_config, model.dtype_bytes)
    return SimTarget(model.model_name, model.model_config, model.dtype_bytes, costs, model, None)


@dataclass(frozen=True)
class SimEngineConfig:
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    kv: KVCapacity


def resolve_engine_config(target: SimTarget, args: EngineArgs) -> SimEngineConfig:
    """The configs LLMEngine.from_engine_args would build for `args` on the target (the
    same steps, in the same order; tests/sim/test_sim_target.py compares the two).

    Raises ConfigError where the engine would refuse to start.
    """
    args = args.with_profile()
    model_max = target.model_config.max_position_embeddings
    max_model_len = args.max_model_len or model_max
    if max_model_len > model_max:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds what {target.model_name} supports ({model_max})"
        )
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if args.enable_chunked_prefill else max_model_len
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,  # type: ignore[arg-type]
        preemption_mode=args.preemption_mode,  # type: ignore[arg-type]
        max_num_partial_prefills=args.max_num_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        prefill_share=1.0 if args.prefill_share is None else args.prefill_share,
    )
    tp = target.tensor_parallel_size
    try:
        kv = kv_capacity(
            costs=target.costs,
            block_size=args.block_size,
            gpu=target.gpu,
            gpu_memory_utilization=args.gpu_memory_utilization,
            activation_bytes=activation_peak_bytes(
                target.model_config, target.dtype_bytes, budget, args.max_num_seqs, tp
            ),
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            swap_space_bytes=int(args.swap_space * GiB) if args.preemption_mode == "swap" else 0,
            tensor_parallel_size=tp,
        )
    except ConfigError as e:
        raise ConfigError(str(e) + _fit_hint(target, args, budget, max_model_len)) from None
    cache_config = CacheConfig(
        block_size=args.block_size,
        num_gpu_blocks=kv.num_gpu_blocks,
        num_cpu_blocks=kv.num_cpu_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    capacity = cache_config.max_num_cached_tokens
    if -(-max_model_len // args.block_size) > cache_config.num_usable_gpu_blocks:
        raise ConfigError(
            f"the KV cache ({kv.how}) holds {capacity} tokens, too few for one request of "
            f"max_model_len={max_model_len}; the largest max_model_len that fits is {capacity}"
            + _fit_hint(target, args, budget, max_model_len)
        )
    return SimEngineConfig(scheduler_config, cache_config, kv)


def _fit_hint(target: SimTarget, args: EngineArgs, budget: int, max_model_len: int) -> str:
    """Where the model does not fit on one GPU's memory: the tensor-parallel sizes at
    which it would (only when the device memory decided the KV cache size)."""
    if target.gpu is None or args.num_gpu_blocks_override is not None or args.kv_cache_memory_bytes is not None:
        return ""
    sizes = tp_sizes_that_fit(
        target.model_config, target.dtype_bytes, target.gpu,
        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
        max_model_len=max_model_len, max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
    )  # fmt: skip
    tp = target.tensor_parallel_size
    if not sizes:
        return f"; it fits at no --tensor-parallel-size up to {MAX_TENSOR_PARALLEL_SIZE} either (now {tp})"
    return f"; it fits with --tensor-parallel-size {', '.join(map(str, sizes))} (now {tp})"
