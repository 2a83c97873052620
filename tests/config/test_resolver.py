"""The one resolver (config/engine_config.py) and the cache sizing (config/cache.py):
pure functions of numbers, tested without torch or a model."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from pagellm.config.cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    CacheBudget,
    MemoryFacts,
    decide_cache_size,
    kv_bytes_per_block,
    sized_cache_config,
)
from pagellm.config.engine_args import PROFILES, EngineArgs
from pagellm.config.engine_config import DeviceFacts, DraftModel, EngineConfig, resolve_engine_config
from pagellm.config.model import ModelConfig, ModelSource
from pagellm.config.units import GiB
from pagellm.errors import ConfigError

# 8 query heads, 2 KV heads of 16, 2 layers, MLP 64, 1024 positions.
MODEL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=1024,
)  # fmt: skip
SOURCE = ModelSource("hf", Path("/models/tiny"), "tiny")
CPU = DeviceFacts(num_cpu_threads=4)
GPU = DeviceFacts(cuda_available=True, num_cpu_threads=4)


def resolve(facts: DeviceFacts = CPU, model: ModelConfig = MODEL, draft: DraftModel | None = None, **args: object) -> EngineConfig:
    return resolve_engine_config(EngineArgs(**args), SOURCE, model, facts, draft)  # type: ignore[arg-type]


# --- device and dtype ------------------------------------------------------------------


@pytest.mark.parametrize("facts, device, dtype, expected", [
    (GPU, "auto", "auto", ("cuda", "bfloat16")),
    (CPU, "auto", "auto", ("cpu", "float32")),  # no native kernels: PyTorch in float32
    (DeviceFacts(cpu_runs_native_kernels=True), "auto", "auto", ("cpu", "bfloat16")),
    (DeviceFacts(cpu_runs_native_kernels=True, cpu_dtype_override="float32"), "auto", "auto", ("cpu", "float32")),
    (GPU, "cpu", "auto", ("cpu", "float32")),
    (GPU, "auto", "float16", ("cuda", "float16")),
    (CPU, "cpu", "bfloat16", ("cpu", "bfloat16")),
])  # fmt: skip
def test_device_and_dtype(facts, device, dtype, expected):
    config = resolve(facts, device=device, dtype=dtype)
    assert (config.device_type, config.dtype) == expected
    assert config.kv_cache_dtype == config.dtype  # auto: the model's


def test_device_and_dtype_errors():
    with pytest.raises(ConfigError, match="device 'cuda' was asked for, but no CUDA device"):
        resolve(CPU, device="cuda")
    with pytest.raises(ConfigError, match="PAGELLM_CPU_DTYPE must be one of"):
        resolve(DeviceFacts(cpu_dtype_override="int4"))


def test_fp8_kv_cache_and_its_bytes():
    config = resolve(GPU, kv_cache_dtype="fp8_e4m3")
    assert (config.dtype, config.kv_cache_dtype) == ("bfloat16", "fp8_e4m3")
    # K and V x 2 layers x 2 KV heads x 16 x 1 byte x 16 tokens: half of bf16's.
    assert kv_bytes_per_block(MODEL, 16, "fp8_e4m3") == 2 * 2 * 2 * 16 * 16 == kv_bytes_per_block(MODEL, 16, "bfloat16") // 2


# --- scheduling ------------------------------------------------------------------------


def test_max_model_len_and_the_token_budget():
    assert resolve().max_model_len == 1024
    assert resolve().scheduler_config.max_num_batched_tokens == 2048
    config = resolve(max_model_len=300, enable_chunked_prefill=False)
    # Without chunked prefill a prompt is scheduled whole: the budget holds the longest.
    assert (config.max_model_len, config.scheduler_config.max_num_batched_tokens) == (300, 300)
    with pytest.raises(ConfigError, match=r"max_model_len=2000 exceeds what tiny supports \(1024\)"):
        resolve(max_model_len=2000)


def test_a_sliding_window_model_keeps_its_whole_context():
    # The window limits what a layer attends to, not how long a request may be.
    windowed = dataclasses.replace(MODEL, sliding_window=64)
    assert resolve(model=windowed).max_model_len == MODEL.max_position_embeddings
    assert resolve(model=windowed, max_model_len=100).max_model_len == 100


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profiles_fill_what_the_user_left_unset(profile):
    scheduler = resolve(profile=profile).scheduler_config
    knobs = PROFILES[profile]
    assert scheduler.max_num_batched_tokens == knobs["max_num_batched_tokens"]
    assert scheduler.max_num_partial_prefills == knobs["max_num_partial_prefills"]
    assert scheduler.long_prefill_token_threshold == knobs["long_prefill_token_threshold"]
    assert scheduler.prefill_share == knobs["prefill_share"]
    # A knob the user set wins over the profile's.
    assert resolve(profile=profile, max_num_batched_tokens=100).scheduler_config.max_num_batched_tokens == 100


def test_swap_space_counts_only_with_swap_preemption():
    assert resolve(swap_space=2.0).cache_budget.swap_space_bytes == 0
    assert resolve(swap_space=2.0, preemption_mode="swap").cache_budget.swap_space_bytes == 2 * GiB


# --- tensor parallelism ----------------------------------------------------------------


def test_tensor_parallel_splits_and_cpu_threads():
    cpu = resolve(tensor_parallel_size=2).parallel_config
    assert (cpu.tensor_parallel_size, cpu.num_threads_per_rank) == (2, 2)  # the 4 cores shared
    assert resolve(GPU, tensor_parallel_size=4).parallel_config.num_threads_per_rank is None
    assert resolve().parallel_config.num_threads_per_rank is None
    # 2 KV heads over 4 ranks: each replicated twice (allowed).
    assert resolve(tensor_parallel_size=4, distributed_executor_backend="ray").parallel_config.distributed_executor_backend == "ray"
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not split this model.*sizes that work: \[1, 2, 4, 8\]"):
        resolve(tensor_parallel_size=3)


# --- speculative decoding --------------------------------------------------------------


def draft(**changes: object) -> DraftModel:
    return DraftModel(ModelSource("gguf", Path("/models/draft.gguf"), "draft"), dataclasses.replace(MODEL, **changes))


def test_draft_models():
    spec = {"model": "/models/draft.gguf", "num_speculative_tokens": 3}
    config = resolve(speculative_config=spec, draft=draft(num_hidden_layers=1))
    assert config.speculative_config.method == "draft_model" and config.draft.source.name == "draft"
    with pytest.raises(ConfigError, match="vocabulary of 50 tokens, the target 100"):
        resolve(speculative_config=spec, draft=draft(vocab_size=50))
    with pytest.raises(ConfigError, match="reaches 512 positions, less than max_model_len=1024"):
        resolve(speculative_config=spec, draft=draft(max_position_embeddings=512))
    with pytest.raises(ConfigError, match="tensor_parallel_size 1 only"):
        resolve(speculative_config=spec, draft=draft(), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="its config must be loaded"):
        resolve(speculative_config=spec)
    with pytest.raises(ConfigError, match="without a speculative_config"):
        resolve(draft=draft())
    ngram = resolve(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert ngram.speculative_config.num_speculative_tokens == 2 and ngram.draft is None


# --- the KV cache's size ---------------------------------------------------------------

BLOCK = kv_bytes_per_block(MODEL, 16, "float32")  # 2 x 2 layers x 2 heads x 16 x 4 bytes x 16 = 8 KiB


def test_precedence_override_then_bytes_then_device():
    facts = MemoryFacts(device_total_bytes=80 * GiB, used_bytes=10 * GiB)
    assert decide_cache_size(CacheBudget(num_gpu_blocks_override=10, kv_cache_memory_bytes=GiB), BLOCK, facts).num_gpu_blocks == 10
    assert decide_cache_size(CacheBudget(kv_cache_memory_bytes=80 * BLOCK), BLOCK, facts).num_gpu_blocks == 81
    gpu = decide_cache_size(CacheBudget(gpu_memory_utilization=0.5), BLOCK, facts)
    assert gpu.num_gpu_blocks == (40 * GiB - 10 * GiB) // BLOCK + 1 and "0.5 of 80 GiB minus 10.00 GiB" in gpu.how
    assert decide_cache_size(CacheBudget(), BLOCK, MemoryFacts()).kv_cache_bytes == DEFAULT_CPU_KV_CACHE_BYTES
    # On CPU at most half of the RAM free now.
    capped = decide_cache_size(CacheBudget(), BLOCK, MemoryFacts(available_ram_bytes=200 * BLOCK))
    assert capped.num_gpu_blocks == 100 + 1
    swap = decide_cache_size(CacheBudget(num_gpu_blocks_override=10, swap_space_bytes=5 * BLOCK), BLOCK, facts)
    assert swap.num_cpu_blocks == 5


def test_sizing_errors():
    with pytest.raises(ConfigError, match="no memory left for the KV cache on H100: peak use"):
        decide_cache_size(CacheBudget(), BLOCK, MemoryFacts(device_total_bytes=GiB, used_bytes=GiB, device_name="H100"))
    with pytest.raises(ConfigError, match="smaller than one block"):
        decide_cache_size(CacheBudget(kv_cache_memory_bytes=BLOCK - 1), BLOCK, MemoryFacts())


def test_a_cache_for_exactly_one_request_and_one_too_small():
    budget = CacheBudget(num_gpu_blocks_override=64 + 1)  # 64 usable blocks of 16 = 1024 tokens
    size = decide_cache_size(budget, BLOCK, MemoryFacts())
    assert sized_cache_config(budget, size, 1024).max_num_cached_tokens == 1024
    small = decide_cache_size(dataclasses.replace(budget, num_gpu_blocks_override=64), BLOCK, MemoryFacts())
    with pytest.raises(ConfigError, match="holds 1008 tokens, too few for one request of max_model_len=1024; "
                                          "the largest max_model_len that fits is 1008"):  # fmt: skip
        sized_cache_config(budget, small, 1024)


def test_engine_config_is_frozen_and_travels():
    config = resolve(tensor_parallel_size=2)
    size = decide_cache_size(config.cache_budget, BLOCK, MemoryFacts())
    sized = config.with_cache(sized_cache_config(config.cache_budget, size, config.max_model_len))
    assert config.cache_config is None and sized.cache_config is not None
    assert pickle.loads(pickle.dumps(sized)) == sized
    with pytest.raises(dataclasses.FrozenInstanceError):
        sized.dtype = "bfloat16"  # type: ignore[misc]
