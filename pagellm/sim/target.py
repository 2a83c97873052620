"""Sim stage: what is simulated (a model on a device, with its step cost model)
and the engine configuration that device would give a set of engine arguments.

Engine arguments are pagellm's own EngineArgs (vLLM's names and defaults); they resolve
through the engine's own resolver (config/) into the EngineConfig the real engine would
build, with the memory facts of the KV cache's sizing estimated from the device preset
instead of measured on a real device.

A target may be a tensor-parallel group: its cost model and its KV cache are then one
GPU's of the group (tensor_parallel_costs.py). Data parallelism is not a property of the
target but of how many of them serve the workload (data_parallel.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.config.cache import CacheSize, MemoryFacts
from pagellm.config.engine_args import EngineArgs
from pagellm.config.engine_config import DeviceFacts, EngineConfig, resolve_engine_config as resolve_config
from pagellm.config.model import ModelConfig, ModelSource
from pagellm.errors import ConfigError
from pagellm.sim.calibrated import CalibratedCostModel
from pagellm.sim.cost_model import StepCostModel
from pagellm.sim.gpu_presets import GpuSpec
from pagellm.sim.kv_capacity import gpu_memory_facts, simulated_cache_size
from pagellm.model.costs import ModelCosts
from pagellm.sim.model_presets import MODEL_PRESETS, get_model_preset
from pagellm.sim.roofline import RooflineCostModel, RooflineParams
from pagellm.sim.tensor_parallel_costs import (
    MAX_TENSOR_PARALLEL_SIZE,
    TensorParallelComm,
    TensorParallelLink,
    rank_costs,
    tp_split_error,
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
    # The prefix cache's disk tier (when the engine arguments give it a size): how fast
    # blocks read back from it, bytes per second.
    tier_read_bytes_per_s: float = 2e9

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
    from pagellm.model.checkpoint import load_model_config, resolve_model_source

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
    """The engine's config on the target, with how its KV cache was sized."""

    engine_config: EngineConfig  # sized (cache_config set)
    kv: CacheSize

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.engine_config.scheduler_config

    @property
    def cache_config(self) -> CacheConfig:
        assert self.engine_config.cache_config is not None
        return self.engine_config.cache_config


# The dtype a CPU target ran in, by its bytes per element (GPU targets are bfloat16, as
# dtype auto resolves there).
_CPU_DTYPES = {4: "float32", 2: "bfloat16"}


def device_facts(target: SimTarget) -> DeviceFacts:
    """The facts the engine would probe on the target's device."""
    if target.gpu is not None:
        return DeviceFacts(cuda_available=True)
    return DeviceFacts(cpu_dtype_override=_CPU_DTYPES.get(target.dtype_bytes, "float32"))


def memory_facts(target: SimTarget, config: EngineConfig) -> MemoryFacts:
    """What one rank would measure before sizing the cache (nothing to measure on CPU)."""
    if target.gpu is None:
        return MemoryFacts()
    scheduler = config.scheduler_config
    return gpu_memory_facts(
        target.model_config, target.dtype_bytes, target.gpu,
        max_num_batched_tokens=scheduler.max_num_batched_tokens, max_num_seqs=scheduler.max_num_seqs,
        tensor_parallel_size=target.tensor_parallel_size,
    )  # fmt: skip


def target_engine_config(target: SimTarget, args: EngineArgs) -> EngineConfig:
    """The engine's resolver (config/) on the target's facts: every setting but the
    KV cache's size."""
    args = dataclasses.replace(args, tensor_parallel_size=target.tensor_parallel_size)
    source = ModelSource("preset", Path(target.model_name), target.model_name)
    return resolve_config(args, source, target.model_config, device_facts(target))


def resolve_engine_config(target: SimTarget, args: EngineArgs) -> SimEngineConfig:
    """The EngineConfig LLMEngine.from_engine_args would build for `args` on the target:
    the engine's resolver and cache sizing, fed the target's facts.

    Raises ConfigError where the engine would refuse to start (with the tensor-parallel
    sizes at which the model would fit, where one GPU's memory is what fails)."""
    config = target_engine_config(target, args)
    try:
        kv = simulated_cache_size(
            target.model_config, config.kv_cache_dtype, config.cache_budget, memory_facts(target, config),
            target.tensor_parallel_size, config.states_per_seat, config.num_state_slots,
        )  # fmt: skip
        cache_config = config.sized_cache(kv)
    except ConfigError as e:
        raise ConfigError(str(e) + _fit_hint(target, config)) from None
    return SimEngineConfig(config.with_cache(cache_config), kv)


def tp_sizes_that_fit(target: SimTarget, config: EngineConfig) -> list[int]:
    """The tensor-parallel sizes (up to one node) at which the model splits and each GPU
    has room for its weights, its activations and the KV of one max_model_len request."""
    assert target.gpu is not None
    scheduler = config.scheduler_config
    sizes = []
    for tp in range(1, MAX_TENSOR_PARALLEL_SIZE + 1):
        if tp_split_error(target.model_config, tp) is not None:
            continue
        memory = gpu_memory_facts(
            target.model_config, target.dtype_bytes, target.gpu,
            max_num_batched_tokens=scheduler.max_num_batched_tokens, max_num_seqs=scheduler.max_num_seqs,
            tensor_parallel_size=tp,
        )  # fmt: skip
        try:
            kv = simulated_cache_size(
                target.model_config, config.kv_cache_dtype, config.cache_budget, memory, tp,
                config.states_per_seat, config.num_state_slots,
            )  # fmt: skip
            config.sized_cache(kv)
        except ConfigError:
            continue
        sizes.append(tp)
    return sizes


def _fit_hint(target: SimTarget, config: EngineConfig) -> str:
    """Where the model does not fit on one GPU's memory: the tensor-parallel sizes at
    which it would (only when the device memory decided the KV cache size)."""
    budget = config.cache_budget
    if target.gpu is None or budget.num_gpu_blocks_override is not None or budget.kv_cache_memory_bytes is not None:
        return ""
    sizes = tp_sizes_that_fit(target, config)
    tp = target.tensor_parallel_size
    if not sizes:
        return f"; it fits at no --tensor-parallel-size up to {MAX_TENSOR_PARALLEL_SIZE} either (now {tp})"
    return f"; it fits with --tensor-parallel-size {', '.join(map(str, sizes))} (now {tp})"
