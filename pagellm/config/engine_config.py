"""Config stage: the one resolver from what the user asked for to every setting of an engine.

`resolve_engine_config` is a pure function of numbers: the user's EngineArgs, the
checkpoint's ModelConfig, the few facts the wiring measured about the machine
(`DeviceFacts`), and the draft model's config where there is one. It makes every
decision (device, dtype, max_model_len, KV cache dtype, the tensor-parallel split,
profiles, speculative checks) and raises ConfigError naming the flag where the settings
cannot work. The engine calls it with facts it probed; the simulator with facts of a
GPU preset. The KV cache's block count needs each rank's memory measured after the
model loads: `EngineConfig.with_cache` adds it (config/cache.py decides it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagellm.config.cache import CacheBudget, CacheConfig, CacheSize, sized_cache_config
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.config.engine_args import EngineArgs
from pagellm.config.model import ModelConfig, ModelSource
from pagellm.config.parallel import ParallelConfig, check_tp_size
from pagellm.config.scheduler import DEFAULT_BACKGROUND_TOKEN_BUDGET, DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from pagellm.config.speculative import SpeculativeConfig, resolve_speculative_config
from pagellm.config.units import GiB
from pagellm.errors import ConfigError

# The dtypes a model may run in (the names of EngineArgs.dtype other than auto).
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DeviceFacts:
    """What the wiring found out about the machine: the resolver's only inputs that
    are neither the user's arguments nor the checkpoint's."""

    cuda_available: bool = False
    # pagellm's C kernels run bf16 models on this CPU (x86-64 with AVX2 and a C compiler);
    # probed only where dtype auto on CPU asks.
    cpu_runs_native_kernels: bool = False
    cpu_dtype_override: str | None = None  # PAGELLM_CPU_DTYPE: what dtype auto means on CPU
    num_cpu_threads: int = 1  # threads torch runs on (shared by CPU ranks)


@dataclass(frozen=True)
class DraftModel:
    """Speculative decoding's draft model: its own weights, same vocabulary."""

    source: ModelSource
    model_config: ModelConfig


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters over the base model: slots beside it, ranks they hold, the host cache."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every resolved setting of an engine: frozen and picklable (it travels to worker
    processes), handed whole to the executor, each worker and the scheduler."""

    source: ModelSource
    model_config: ModelConfig  # the whole model (a rank derives its share)
    device_type: str  # "cpu" | "cuda"
    dtype: str  # weights and activations: "float32" | "bfloat16" | "float16"
    kv_cache_dtype: str  # dtype, or "fp8_e4m3" | "fp8_e5m2"
    scheduler_config: SchedulerConfig
    cache_budget: CacheBudget
    cache_config: CacheConfig | None = None  # None until each rank's memory was measured
    parallel_config: ParallelConfig = ParallelConfig()
    speculative_config: SpeculativeConfig | None = None
    draft: DraftModel | None = None
    seed: int = 0
    load_format: str = "auto"
    quantization: str = "auto"
    int8_activations: bool = False
    attention_backend: str = "auto"
    enforce_eager: bool = False
    max_capture_batch_size: int | None = None  # None: min(max_num_seqs, 512)
    max_logprobs: int = 20
    log_stats_interval: float | None = None  # None: no periodic stats line
    metrics_series_file: str | None = None
    kv_events_file: str | None = None
    lora_config: LoRAConfig | None = None  # None: no adapters

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def with_cache(self, cache_config: CacheConfig) -> EngineConfig:
        """This config with the cache sized (sized_cache below); a hybrid's seats cut to its
        recurrent-state slots where the budget held fewer than max_num_seqs."""
        scheduler = self.scheduler_config
        if self.model_config.linear_attention is not None and cache_config.num_state_slots < scheduler.max_num_seqs:
            scheduler = dataclasses.replace(scheduler, max_num_seqs=cache_config.num_state_slots)
        return dataclasses.replace(self, cache_config=cache_config, scheduler_config=scheduler)

    def sized_cache(self, size: CacheSize) -> CacheConfig:
        """The cache of `size` blocks for this engine: the model's KV cache groups, and a
        request of max_model_len checked to fit (steps of max_num_batched_tokens); a
        hybrid's state slots (and as many snapshots, with prefix caching) as `size` chose."""
        slots = min(size.num_state_slots, self.num_state_slots) if size.num_state_slots else self.num_state_slots
        snapshots = slots if self.num_state_snapshots else 0
        return sized_cache_config(
            self.cache_budget, size, self.max_model_len, kv_cache_layout(self.model_config).windows,
            self.scheduler_config.max_num_batched_tokens, slots, snapshots, self.host_state_slots(slots),
        )  # fmt: skip

    def host_state_slots(self, num_state_slots: int) -> int:
        """A hybrid's host slots for swapped-out requests' states: one per device slot under
        swap preemption (host memory besides swap_space), none otherwise."""
        return num_state_slots if self.scheduler_config.preemption_mode == "swap" else 0

    @property
    def states_per_seat(self) -> int:
        """A hybrid's recurrent states per running request: its slot, and its snapshot with
        prefix caching (0: not a hybrid)."""
        if not self.num_state_slots:
            return 0
        return 2 if self.num_state_snapshots else 1

    @property
    def num_state_slots(self) -> int:
        """A hybrid model's recurrent-state slots: one per request that may run at once
        (0: not a hybrid)."""
        return self.scheduler_config.max_num_seqs if self.model_config.linear_attention is not None else 0

    @property
    def num_state_snapshots(self) -> int:
        """A hybrid model's snapshots of recurrent state for prefix hits: as many as seats
        (each running conversation keeps its latest; least recently used out)."""
        return self.num_state_slots if self.cache_budget.enable_prefix_caching else 0


def resolve_device_type(name: str, facts: DeviceFacts) -> str:
    """"auto": cuda where a CUDA device is available, else cpu."""
    if name == "auto":
        return "cuda" if facts.cuda_available else "cpu"
    if name == "cuda" and not facts.cuda_available:
        raise ConfigError("device 'cuda' was asked for, but no CUDA device is available")
    return name


def resolve_dtype(name: str, device_type: str, facts: DeviceFacts) -> str:
    """"auto": bfloat16 on GPUs and on CPUs where the native kernels run, else float32.

    On CPU bf16 is what the kernels read (a GGUF stays quantized only there); they compute in
    bf16 where the CPU has AVX-512 BF16 or AMX and in float32 on bf16 inputs on AVX2, and
    bf16 is faster on both (docs/performance.md). PAGELLM_CPU_DTYPE pins the CPU choice
    (the tests pin float32: the exactness reference against HF transformers).
    """
    if name != "auto":
        return name
    if device_type == "cuda":
        return "bfloat16"
    forced = facts.cpu_dtype_override
    if forced:
        if forced not in MODEL_DTYPES:
            raise ConfigError(f"PAGELLM_CPU_DTYPE must be one of {sorted(MODEL_DTYPES)}, got {forced!r}")
        return forced
    return "bfloat16" if facts.cpu_runs_native_kernels else "float32"


def resolve_max_model_len(requested: int | None, model_config: ModelConfig, model_name: str = "the model") -> int:
    """The model's context length, or the user's shorter one."""
    model_max = model_config.max_position_embeddings
    if requested is None:
        return model_max
    if requested > model_max:
        raise ConfigError(f"max_model_len={requested} exceeds what {model_name} supports ({model_max})")
    return requested


def check_draft_model(draft: DraftModel, target: ModelConfig, max_model_len: int, tensor_parallel_size: int) -> None:
    """A draft proposes tokens as the target's: same vocabulary, reaching max_model_len,
    and full attention in both (the draft's K/V follows the target's one block table,
    whose early blocks a sliding window would free)."""
    if tensor_parallel_size > 1:
        raise ConfigError("speculative_config: a draft model runs with tensor_parallel_size 1 only")
    name, config = draft.source.name, draft.model_config
    if target.sliding_window is not None or config.sliding_window is not None:
        raise ConfigError(
            "speculative_config: a draft model is not supported with sliding-window attention "
            f"(the {'target' if target.sliding_window is not None else 'draft'} model has a window); "
            "use method 'ngram'"
        )
    if config.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative_config: the draft model {name!r} has a vocabulary of {config.vocab_size} tokens, "
            f"the target {target.vocab_size}: a draft must use the target's tokenizer"
        )
    if config.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"speculative_config: the draft model {name!r} reaches {config.max_position_embeddings} "
            f"positions, less than max_model_len={max_model_len}"
        )


def resolve_engine_config(
    args: EngineArgs,
    source: ModelSource,
    model_config: ModelConfig,
    facts: DeviceFacts,
    draft: DraftModel | None = None,
) -> EngineConfig:
    """Every setting of the engine `args` ask for on this model and machine, but the
    KV cache's block count. Raises ConfigError where the engine cannot start."""
    args = hybrid_model_args(args.with_profile(), model_config)
    device_type = resolve_device_type(args.device, facts)
    dtype = resolve_dtype(args.dtype, device_type, facts)
    max_model_len = resolve_max_model_len(args.max_model_len, model_config, source.name)
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS if args.enable_chunked_prefill else max_model_len
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,  # type: ignore[arg-type]
        preemption_mode=args.preemption_mode,  # type: ignore[arg-type]
        max_num_partial_prefills=args.max_num_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        prefill_share=1.0 if args.prefill_share is None else args.prefill_share,
        background_token_budget=background_token_budget(args),
        max_loras=args.max_loras if args.enable_lora else None,
        num_scheduler_steps=args.num_scheduler_steps,
    )
    lora_config = None
    if args.enable_lora:
        lora_config = LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras)
    tp_size = args.tensor_parallel_size
    if tp_size > 1:
        check_tp_size(model_config, tp_size)
    speculative_config = resolve_speculative_config(args.speculative_config)
    wants_draft = speculative_config is not None and speculative_config.model is not None
    if wants_draft != (draft is not None):
        raise ConfigError(
            "speculative_config names a draft model: its config must be loaded for the resolver"
            if wants_draft
            else "a draft model was given without a speculative_config that names it"
        )
    if draft is not None:
        check_draft_model(draft, model_config, max_model_len, tp_size)
    parallel_config = ParallelConfig(
        tensor_parallel_size=tp_size,
        distributed_executor_backend=args.distributed_executor_backend,
        # CPU ranks share the machine's cores.
        num_threads_per_rank=max(1, facts.num_cpu_threads // tp_size) if tp_size > 1 and device_type == "cpu" else None,
    )
    cache_budget = CacheBudget(
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        # Host blocks are only ever used by swap preemption.
        swap_space_bytes=int(args.swap_space * GiB) if args.preemption_mode == "swap" else 0,
        kv_offload_path=args.kv_offload_path,
        kv_offload_bytes=args.kv_offload_bytes,
        kv_offload_host_bytes=args.kv_offload_host_bytes,
        state_snapshot_interval=args.state_snapshot_interval,
    )
    return EngineConfig(
        source=source,
        model_config=model_config,
        device_type=device_type,
        dtype=dtype,
        # fp8 caches take 1 byte per element: twice the blocks of bf16 in the same budget.
        kv_cache_dtype=dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        scheduler_config=scheduler_config,
        cache_budget=cache_budget,
        parallel_config=parallel_config,
        speculative_config=speculative_config,
        draft=draft,
        seed=args.seed,
        load_format=args.load_format,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_capture_batch_size=args.max_capture_batch_size,
        max_logprobs=args.max_logprobs,
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        metrics_series_file=args.metrics_series_file,
        kv_events_file=args.kv_events_file,
        lora_config=lora_config,
    )


def hybrid_model_args(args: EngineArgs, model_config: ModelConfig) -> EngineArgs:
    """A hybrid model (linear-attention layers with recurrent state): LoRA and speculative
    decoding are refused."""
    if model_config.linear_attention is None:
        return args
    refused = [
        (args.enable_lora, "enable_lora"),
        (args.speculative_config is not None, "speculative_config (a rejected token would stay in the state)"),
    ]
    for asked, what in refused:
        if asked:
            raise ConfigError(f"{what} is not supported yet on a hybrid model (linear-attention layers)")
    return args


def background_token_budget(args: EngineArgs) -> int | None:
    """The scheduler's cap on background tokens per step (see EngineArgs)."""
    if args.background_token_budget is None:
        return DEFAULT_BACKGROUND_TOKEN_BUDGET if args.enable_chunked_prefill else None
    return args.background_token_budget or None
