"""KV cache sizing without a device: the engine's sizing fed the memory a GPU preset
would measure, against hand-computed budgets."""

from __future__ import annotations

import pytest

from pagellm.config.cache import CacheBudget, kv_bytes_per_block
from pagellm.config.units import GiB
from pagellm.errors import ConfigError
from pagellm.model.costs import ModelCosts
from pagellm.sim.gpu_presets import get_gpu_preset
from pagellm.sim.kv_capacity import (
    GPU_RUNTIME_RESERVE_BYTES,
    activation_peak_bytes,
    gpu_memory_facts,
    simulated_cache_size,
)
from pagellm.sim.model_presets import get_model_preset

LLAMA_8B = get_model_preset("Llama-3-8B")


def test_llama3_8b_on_h100_by_hand():
    # A block of 16 tokens: K and V x 32 layers x 8 KV heads x 128 x 2 bytes x 16 = 2 MiB.
    assert kv_bytes_per_block(LLAMA_8B.config, 16, "bfloat16") == 2 * 32 * 8 * 128 * 2 * 16 == 2 * 1024 * 1024
    memory = gpu_memory_facts(LLAMA_8B.config, 2, get_gpu_preset("H100-SXM"), max_num_batched_tokens=2048, max_num_seqs=256)
    activations = activation_peak_bytes(LLAMA_8B.config, 2, 2048, 256)
    assert memory.used_bytes == 8_030_261_248 * 2 + activations + GPU_RUNTIME_RESERVE_BYTES
    kv = simulated_cache_size(LLAMA_8B.config, "bfloat16", CacheBudget(gpu_memory_utilization=0.9), memory)
    budget = int(80 * GiB * 0.9) - memory.used_bytes
    assert kv.num_gpu_blocks == budget // (2 * 1024 * 1024) + 1  # + the null block
    assert kv.kv_cache_bytes == (kv.num_gpu_blocks - 1) * 2 * 1024 * 1024
    assert "0.9 of 80 GiB" in kv.how and "runtime reserve 1.00 GiB" in kv.how


def test_fp8_kv_cache_holds_twice_the_blocks():
    memory = gpu_memory_facts(LLAMA_8B.config, 2, get_gpu_preset("H100-SXM"), max_num_batched_tokens=2048, max_num_seqs=256)
    budget = CacheBudget()
    bf16 = simulated_cache_size(LLAMA_8B.config, "bfloat16", budget, memory)
    fp8 = simulated_cache_size(LLAMA_8B.config, "fp8_e4m3", budget, memory)
    # floor(B / (b / 2)) is 2 floor(B / b) or one more.
    assert 2 * (bf16.num_gpu_blocks - 1) <= fp8.num_gpu_blocks - 1 <= 2 * (bf16.num_gpu_blocks - 1) + 1


def test_activation_estimate_by_hand():
    # 2048 tokens x (2*14336 + 4096 + 2*1024 + 3*4096) x 2 bytes, plus float32 logits of
    # min(256, 2048) rows x 128256.
    expected = 2048 * (2 * 14336 + 4096 + 2 * 1024 + 3 * 4096) * 2 + 256 * 128256 * 4
    assert activation_peak_bytes(LLAMA_8B.config, 2, 2048, 256) == expected


def test_a_model_that_does_not_fit_is_refused():
    config_70b = get_model_preset("Llama-3-70B").config
    memory = gpu_memory_facts(config_70b, 2, get_gpu_preset("L4"), max_num_batched_tokens=2048, max_num_seqs=256)
    with pytest.raises(ConfigError, match="no memory left for the KV cache on L4"):
        simulated_cache_size(config_70b, "bfloat16", CacheBudget(), memory)


def test_cost_model_kv_bytes_equal_the_cache_blocks():
    """The roofline's KV traffic per token and the cache's block size count the same bytes."""
    for name in ("Llama-3-8B", "SmolLM2-135M", "Qwen2.5-7B"):
        config = get_model_preset(name).config
        for dtype, size in (("bfloat16", 2), ("float32", 4)):
            assert ModelCosts.from_config(config, size).kv_bytes_per_block(16) == kv_bytes_per_block(config, 16, dtype)
