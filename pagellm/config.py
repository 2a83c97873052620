"""Engine configuration (setup stage): frozen dataclasses validated on construction.

Configs are never mutated. A derived value (for instance the number of KV blocks measured
after the model is loaded) is resolved into a new object with `dataclasses.replace`,
which runs the validation again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pagellm.errors import ConfigError

SchedulingPolicy = Literal["fcfs", "priority", "shortest-remaining"]
PreemptionMode = Literal["recompute", "swap"]

SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority", "shortest-remaining")
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap")
# torch: the reference; cpu: the compiled CPU decode kernel; triton: the GPU kernels.
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton")
# auto: weights from the checkpoint; dummy: random weights of the checkpoint's shapes,
# made on the device (benchmarks of large shapes without their files).
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")
QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "none", "int8")
# auto: the KV cache in the model's dtype; fp8_*: 8-bit floats (torch.float8_e4m3fn,
# torch.float8_e5m2), half the bytes of bf16, per-tensor scale 1.0, saturated on store.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")
# Where the ranks of a tensor-parallel model run: processes on this machine, or Ray actors.
DISTRIBUTED_EXECUTOR_BACKENDS: tuple[str, ...] = ("mp", "ray")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; `block_size=True` is a bug, not a size.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be an integer, got {value!r}.")
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be at least {minimum}, got {value}.")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Shape of the paged KV cache.

    num_gpu_blocks counts every device block including block 0, which the block pool
    reserves as a null block; the usable capacity is (num_gpu_blocks - 1) * block_size
    tokens. num_cpu_blocks is the host pool used when requests are swapped out
    (0 = swapping impossible; swap preemption then falls back to recompute).
    """

    block_size: int = 16
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_int("CacheConfig", "block_size", self.block_size, 1)
        # Block 0 is the null block, so one more is needed to hold any token at all.
        _check_int("CacheConfig", "num_gpu_blocks", self.num_gpu_blocks, 2)
        _check_int("CacheConfig", "num_cpu_blocks", self.num_cpu_blocks, 0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                "CacheConfig.enable_prefix_caching must be a bool, "
                f"got {self.enable_prefix_caching!r}."
            )

    @property
    def num_usable_gpu_blocks(self) -> int:
        """Device blocks that can hold tokens (all but the null block)."""
        return self.num_gpu_blocks - 1

    @property
    def max_num_cached_tokens(self) -> int:
        """Most tokens the device cache can hold at once."""
        return self.num_usable_gpu_blocks * self.block_size


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits and policy of the continuous-batching scheduler.

    max_num_batched_tokens is the token budget of one forward pass; max_num_seqs caps the
    number of running requests. Without chunked prefill a prompt is only ever scheduled
    whole, so the budget must be able to hold the longest possible one.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    preemption_mode: PreemptionMode = "recompute"
    max_num_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    prefill_share: float = 1.0

    def __post_init__(self) -> None:
        _check_int("SchedulerConfig", "max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_partial_prefills is not None:
            _check_int("SchedulerConfig", "max_num_partial_prefills", self.max_num_partial_prefills, 1)
        if self.long_prefill_token_threshold is not None:
            _check_int("SchedulerConfig", "long_prefill_token_threshold", self.long_prefill_token_threshold, 1)
        if isinstance(self.prefill_share, bool) or not isinstance(self.prefill_share, (int, float)):
            raise ConfigError(f"SchedulerConfig.prefill_share must be a number, got {self.prefill_share!r}.")
        if not 0.0 < self.prefill_share <= 1.0:
            raise ConfigError(
                f"SchedulerConfig.prefill_share must be in (0, 1], got {self.prefill_share} "
                "(0 would starve new requests while any request decodes)."
            )
        _check_int("SchedulerConfig", "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("SchedulerConfig", "max_model_len", self.max_model_len, 1)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ConfigError(
                "SchedulerConfig.enable_chunked_prefill must be a bool, "
                f"got {self.enable_chunked_prefill!r}."
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"SchedulerConfig.scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}."
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"SchedulerConfig.preemption_mode must be one of {PREEMPTION_MODES}, "
                f"got {self.preemption_mode!r}."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "With chunked prefill disabled a prompt is scheduled whole, so "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}). Raise max_num_batched_tokens, lower "
                "max_model_len, or enable chunked prefill."
            )
        if not self.enable_chunked_prefill and self.balances_prefill:
            raise ConfigError(
                "max_num_partial_prefills, long_prefill_token_threshold and prefill_share < 1 "
                "split prefills over steps: they need chunked prefill enabled."
            )

    @property
    def balances_prefill(self) -> bool:
        """Whether any prefill/decode balance knob is set away from 'no limit'."""
        return (
            self.max_num_partial_prefills is not None
            or self.long_prefill_token_threshold is not None
            or self.prefill_share < 1.0
        )


SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): `ngram` proposes, for each
    decode, up to num_speculative_tokens that followed the latest earlier occurrence of
    its last n tokens (n from prompt_lookup_max down to prompt_lookup_min); `draft_model`
    (given as {"model": PATH, ...}) runs a smaller model with the same vocabulary to
    propose them. The target model verifies them in the same step. No step speculates
    with more running requests than disable_by_batch_size (there decoding is
    compute-bound and verification costs more than it saves)."""

    method: str = "ngram"
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    model: str | None = None  # the draft model (GGUF file or HF folder)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError(
                "speculative_config: a draft model needs method 'draft_model' and a model path"
                if self.method == "draft_model"
                else f"speculative_config: method {self.method!r} takes no model (a draft model is method 'draft_model')"
            )
        _check_int("speculative_config", "num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("speculative_config", "prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("speculative_config", "prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        if self.disable_by_batch_size is not None:
            _check_int("speculative_config", "disable_by_batch_size", self.disable_by_batch_size, 1)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> SpeculativeConfig:
        """From the user's dict (or JSON object); {"model": ...} alone means method 'draft_model'."""
        values = dict(values)
        if values.get("model") is not None:
            values.setdefault("method", "draft_model")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown} (known: {sorted(known)})")
        if "num_speculative_tokens" not in values:
            raise ConfigError("speculative_config needs num_speculative_tokens")
        return cls(**values)  # type: ignore[arg-type]


def resolve_speculative_config(value: object) -> SpeculativeConfig | None:
    """--speculative-config: None, a dict, or its JSON text."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object, got {value!r}")
    return SpeculativeConfig.from_dict(value)
