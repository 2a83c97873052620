"""Config validation: frozen dataclasses that refuse impossible values with clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.errors import ConfigError


def test_cache_config_defaults() -> None:
    config = CacheConfig(num_gpu_blocks=10)
    assert config.block_size == 16
    assert config.num_cpu_blocks == 0
    assert config.enable_prefix_caching is True
    # Block 0 is the null block.
    assert config.num_usable_gpu_blocks == 9
    assert config.max_num_cached_tokens == 9 * 16


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(num_gpu_blocks=10, block_size=0), "block_size must be at least 1"),
        (dict(num_gpu_blocks=10, block_size=2.0), "block_size must be an integer"),
        (dict(num_gpu_blocks=10, block_size=True), "block_size must be an integer"),
        (dict(num_gpu_blocks=1), "num_gpu_blocks must be at least 2"),
        (dict(num_gpu_blocks=10, num_cpu_blocks=-1), "num_cpu_blocks must be at least 0"),
        (dict(num_gpu_blocks=10, enable_prefix_caching="yes"), "must be a bool"),
    ],
)
def test_cache_config_rejects(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        CacheConfig(**kwargs)


def test_cache_config_requires_num_gpu_blocks() -> None:
    with pytest.raises(TypeError):
        CacheConfig()  # type: ignore[call-arg]


def test_scheduler_config_defaults() -> None:
    config = SchedulerConfig(max_model_len=4096)
    assert config.max_num_seqs == 256
    assert config.max_num_batched_tokens == 2048
    assert config.enable_chunked_prefill is True
    assert config.scheduling_policy == "fcfs"
    assert config.preemption_mode == "recompute"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(max_model_len=0), "max_model_len must be at least 1"),
        (dict(max_model_len=64, max_num_seqs=0), "max_num_seqs must be at least 1"),
        (dict(max_model_len=64, max_num_batched_tokens=0), "max_num_batched_tokens must be"),
        (dict(max_model_len=64, scheduling_policy="lifo"), "scheduling_policy must be one of"),
        (dict(max_model_len=64, preemption_mode="kill"), "preemption_mode must be one of"),
        (dict(max_model_len=64, enable_chunked_prefill=1), "must be a bool"),
    ],
)
def test_scheduler_config_rejects(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        SchedulerConfig(**kwargs)


def test_no_chunked_prefill_needs_budget_for_the_longest_prompt() -> None:
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(
            max_model_len=4096, max_num_batched_tokens=2048, enable_chunked_prefill=False
        )
    message = str(info.value)
    assert "2048" in message and "4096" in message and "chunked prefill" in message
    # Equal is enough.
    SchedulerConfig(max_model_len=2048, max_num_batched_tokens=2048, enable_chunked_prefill=False)


def test_configs_are_frozen_and_replace_revalidates() -> None:
    config = CacheConfig(num_gpu_blocks=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_gpu_blocks = 20  # type: ignore[misc]
    resolved = dataclasses.replace(config, num_gpu_blocks=100)
    assert resolved.num_gpu_blocks == 100 and config.num_gpu_blocks == 10
    with pytest.raises(ConfigError):
        dataclasses.replace(config, num_gpu_blocks=0)
    sched = SchedulerConfig(max_model_len=64)
    with pytest.raises(ConfigError):
        dataclasses.replace(sched, enable_chunked_prefill=False, max_num_batched_tokens=32)
