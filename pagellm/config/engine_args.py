"""Config stage: the engine arguments users set, with vLLM's names and defaults."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from pagellm.config.cache import DEFAULT_STATE_SNAPSHOT_INTERVAL, KV_CACHE_DTYPES
from pagellm.config.parallel import DISTRIBUTED_EXECUTOR_BACKENDS
from pagellm.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES
from pagellm.config.speculative import resolve_speculative_config
from pagellm.errors import ConfigError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# torch: the reference; cpu: the compiled CPU decode kernel; triton: the GPU kernels.
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton")
# auto: weights from the checkpoint; dummy: random weights of the checkpoint's shapes,
# made on the device (benchmarks of large shapes without their files).
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")
QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "none", "int8")
PROFILE_CHOICES = ("interactive", "offline")
DEFAULT_KV_OFFLOAD_BYTES = 8 * 1024**3

# What each --profile sets, for the knobs the user left unset. interactive keeps steps
# short while requests decode (inter-token latency); offline makes steps big (throughput).
PROFILES: dict[str, dict[str, object]] = {
    "interactive": {
        "max_num_batched_tokens": 512,
        "max_num_partial_prefills": 1,
        "long_prefill_token_threshold": 256,
        "prefill_share": 0.25,
    },
    "offline": {
        "max_num_batched_tokens": 8192,
        "max_num_partial_prefills": None,
        "long_prefill_token_threshold": None,
        "prefill_share": 1.0,
    },
}


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """Everything that shapes an engine. Each field is also a CLI flag (--max-num-seqs)."""

    model: str | None = None  # GGUF file or HF folder; None = embedded SmolLM2
    dtype: str = "auto"  # auto = bfloat16 on GPU and on CPUs with native bf16, else float32
    device: str = "auto"  # auto = cuda if available
    seed: int = 0
    load_format: str = "auto"  # auto | dummy (random weights of the checkpoint's shapes)
    # auto: a GGUF's quantized weights stay as stored where the CPU kernels run them;
    # none: dequantize everything; int8: weight-only int8 (per-row scales) from a float checkpoint
    quantization: str = "auto"
    # Q4_0 / Q4_1 weights on the CPU kernels: multiply them with activations rounded to
    # int8 per 32 values (llama.cpp's arithmetic) where that is measured faster
    int8_activations: bool = False
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    max_capture_batch_size: int | None = None  # largest decode batch graphed; None = min(max_num_seqs, 512)
    max_model_len: int | None = None  # None = the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = 2048 (chunked) or max_model_len
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; fp8_e4m3 | fp8_e5m2: 1 byte per element
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    # The prefix cache's second tier: a directory on local disk that keeps evicted
    # prefix blocks (and keeps them across restarts), and its size bound in bytes
    kv_offload_path: str | None = None
    kv_offload_bytes: int = DEFAULT_KV_OFFLOAD_BYTES
    # and its latest blocks kept in host memory in front of the disk; None: 4 GiB when
    # the KV cache is on a GPU, none on CPU (the KV cache is host memory already)
    kv_offload_host_bytes: int | None = None
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    # A hybrid model (linear attention): with prefix caching, its recurrent state is kept
    # after every this many full blocks, so that a hit resumes from there.
    state_snapshot_interval: int = DEFAULT_STATE_SNAPSHOT_INTERVAL
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # fcfs, priority, shortest-remaining
    # Prefill/decode balance (SchedulerConfig explains each); None = unset, and then the
    # profile's value or no limit.
    max_num_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    prefill_share: float | None = None
    # Tokens batch lines may take per step; None: DEFAULT_BACKGROUND_TOKEN_BUDGET with
    # chunked prefill, no cap without (a prompt is then scheduled whole); 0: no cap.
    background_token_budget: int | None = None
    profile: str | None = None  # interactive | offline: sets the knobs above together
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for
    disable_log_stats: bool = False  # no periodic stats line
    log_stats_interval: float = 5.0  # seconds between stats lines while busy
    metrics_series_file: str | None = None  # JSONL time series (one point per second)
    kv_events_file: str | None = None  # JSONL log of every KV block event
    tensor_parallel_size: int = 1  # ranks the model is split over (heads, MLP, vocabulary)
    distributed_executor_backend: str | None = None  # mp | ray; None = mp (processes on this machine)
    # vLLM's shape, a dict or its JSON: {"method": "ngram", "num_speculative_tokens": 4, ...}
    speculative_config: str | dict[str, object] | None = None
    # Decode steps per engine step while every running request decodes (vLLM's name):
    # the scheduler's and the engine's Python once per N tokens instead of once per token.
    num_scheduler_steps: int = 1
    # LoRA adapters over the base model (vLLM's names and defaults)
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident at once, hence the most in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.device not in DEVICE_CHOICES:
            raise ConfigError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.max_capture_batch_size is not None and self.max_capture_batch_size < 1:
            raise ConfigError(f"max_capture_batch_size must be >= 1, got {self.max_capture_batch_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_offload_bytes <= 0 and self.kv_offload_path is not None:
            raise ConfigError(f"kv_offload_bytes must be positive, got {self.kv_offload_bytes}")
        interval = self.state_snapshot_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"state_snapshot_interval must be an integer >= 1 (blocks), got {interval!r}")
        if self.kv_offload_host_bytes is not None and self.kv_offload_host_bytes < 0:
            raise ConfigError(f"kv_offload_host_bytes must be >= 0, got {self.kv_offload_host_bytes}")
        if self.kv_offload_path is not None and os.path.exists(self.kv_offload_path) and not os.path.isdir(self.kv_offload_path):
            raise ConfigError(f"kv_offload_path {self.kv_offload_path} is a file; it must be a directory (made if missing)")
        if self.kv_offload_path is not None and self.tensor_parallel_size > 1:
            raise ConfigError(
                "kv_offload_path (the prefix cache's disk tier) does not work with tensor_parallel_size > 1 yet"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(
                "num_gpu_blocks_override must be at least 2 (block 0 is reserved), "
                f"got {self.num_gpu_blocks_override}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.log_stats_interval <= 0:
            raise ConfigError(
                f"log_stats_interval must be positive (use disable_log_stats to turn the "
                f"stats line off), got {self.log_stats_interval}"
            )
        if self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.profile is not None and self.profile not in PROFILE_CHOICES:
            raise ConfigError(f"profile must be one of {PROFILE_CHOICES}, got {self.profile!r}")
        if self.profile is not None and not self.enable_chunked_prefill:
            raise ConfigError("profile sets chunked-prefill knobs: it needs enable_chunked_prefill")
        resolve_speculative_config(self.speculative_config)  # a bad one fails here, named
        steps = self.num_scheduler_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"num_scheduler_steps must be an integer >= 1, got {steps!r}")
        if steps > 1 and self.speculative_config is not None:
            raise ConfigError("num_scheduler_steps > 1 does not work with speculative_config: choose one")
        if steps > 1 and self.tensor_parallel_size > 1:
            raise ConfigError("num_scheduler_steps > 1 does not work with tensor_parallel_size > 1 yet")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if isinstance(self.tensor_parallel_size, bool) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if (
            self.distributed_executor_backend is not None
            and self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS
        ):
            raise ConfigError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )

    def with_profile(self) -> EngineArgs:
        """These arguments with the profile's values filled into the unset knobs."""
        if self.profile is None:
            return self
        unset = {k: v for k, v in PROFILES[self.profile].items() if getattr(self, k) is None}
        return dataclasses.replace(self, **unset)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        """EngineArgs from keyword arguments, naming any unknown one."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown engine argument(s): {', '.join(unknown)} "
                f"(known: {', '.join(cls.field_names())})"
            )
        return cls(**kwargs)  # type: ignore[arg-type]
