"""KV cache sizing without a device, against hand-computed budgets and the engine's own."""

from __future__ import annotations

import pytest

from pagellm.errors import ConfigError
from pagellm.sim.gpu_presets import GiB, get_gpu_preset
from pagellm.sim.kv_capacity import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    GPU_RUNTIME_RESERVE_BYTES,
    activation_peak_bytes,
    kv_capacity,
)
from pagellm.model.costs import ModelCosts
from pagellm.sim.model_presets import get_model_preset

LLAMA_8B = get_model_preset("Llama-3-8B")
COSTS_8B = ModelCosts.from_config(LLAMA_8B.config, 2)


def test_llama3_8b_on_h100_by_hand():
    # A block of 16 tokens: K and V x 32 layers x 8 KV heads x 128 x 2 bytes x 16 = 2 MiB.
    assert COSTS_8B.kv_bytes_per_block(16) == 2 * 32 * 8 * 128 * 2 * 16 == 2 * 1024 * 1024
    activations = 123 * 1024 * 1024
    kv = kv_capacity(costs=COSTS_8B, block_size=16, gpu=get_gpu_preset("H100-SXM"),
                     gpu_memory_utilization=0.9, activation_bytes=activations)  # fmt: skip
    budget = int(80 * GiB * 0.9 - 8_030_261_248 * 2 - activations - GPU_RUNTIME_RESERVE_BYTES)
    assert kv.num_gpu_blocks == budget // (2 * 1024 * 1024) + 1  # + the null block
    assert kv.kv_cache_bytes == (kv.num_gpu_blocks - 1) * 2 * 1024 * 1024
    assert "0.9 of 80 GiB" in kv.how


def test_activation_estimate_by_hand():
    # 2048 tokens x (2*14336 + 4096 + 2*1024 + 3*4096) x 2 bytes, plus float32 logits of
    # min(256, 2048) rows x 128256.
    expected = 2048 * (2 * 14336 + 4096 + 2 * 1024 + 3 * 4096) * 2 + 256 * 128256 * 4
    assert activation_peak_bytes(LLAMA_8B.config, 2, 2048, 256) == expected


def test_precedence_override_then_bytes_then_device():
    common = dict(costs=COSTS_8B, block_size=16, gpu=get_gpu_preset("H100-SXM"),
                  gpu_memory_utilization=0.9, activation_bytes=0)  # fmt: skip
    assert kv_capacity(**common, num_gpu_blocks_override=10, kv_cache_memory_bytes=GiB).num_gpu_blocks == 10
    assert kv_capacity(**common, kv_cache_memory_bytes=GiB).num_gpu_blocks == 512 + 1
    cpu = kv_capacity(**{**common, "gpu": None})
    assert cpu.kv_cache_bytes == DEFAULT_CPU_KV_CACHE_BYTES
    swap = kv_capacity(**common, num_gpu_blocks_override=10, swap_space_bytes=4 * GiB)
    assert swap.num_cpu_blocks == 2048


def test_a_model_that_does_not_fit_is_refused():
    costs_70b = ModelCosts.from_config(get_model_preset("Llama-3-70B").config, 2)
    with pytest.raises(ConfigError, match="no memory left for the KV cache on L4"):
        kv_capacity(costs=costs_70b, block_size=16, gpu=get_gpu_preset("L4"),
                    gpu_memory_utilization=0.9, activation_bytes=0)  # fmt: skip


def test_sizes_agree_with_the_engine():
    torch = pytest.importorskip("torch")
    from pagellm.worker.cache_sizing import DEFAULT_CPU_KV_CACHE_BYTES as ENGINE_DEFAULT
    from pagellm.worker.kv_cache import kv_cache_bytes_per_block

    assert DEFAULT_CPU_KV_CACHE_BYTES == ENGINE_DEFAULT
    for name in ("Llama-3-8B", "SmolLM2-135M", "Qwen2.5-7B"):
        config = get_model_preset(name).config
        for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
            assert ModelCosts.from_config(config, size).kv_bytes_per_block(16) == kv_cache_bytes_per_block(config, 16, dtype)
