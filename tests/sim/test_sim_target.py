"""The simulator resolves engine arguments into the very configs the engine builds."""

from __future__ import annotations

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sim.calibrated import CalibratedCostModel, FitQuality, StepCostFit
from pagellm.sim.sim_target import calibrated_target, resolve_engine_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-target"), "llama", seed=2))


@pytest.mark.parametrize("fields", [
    {},
    {"max_model_len": 256, "max_num_seqs": 7, "max_num_batched_tokens": 100, "block_size": 8},
    {"max_model_len": 128, "enable_chunked_prefill": False, "num_gpu_blocks_override": 40},
    {"max_model_len": 256, "kv_cache_memory_bytes": 1 << 20, "preemption_mode": "swap", "swap_space": 0.01},
    {"max_model_len": 256, "profile": "interactive"},
    {"max_model_len": 256, "prefill_share": 0.5, "max_num_partial_prefills": 2,
     "long_prefill_token_threshold": 64, "scheduling_policy": "shortest-remaining"},
])  # fmt: skip
def test_same_configs_as_the_engine(tiny_model, fields):
    args = EngineArgs(model=tiny_model, dtype="float32", disable_log_stats=True, **fields)
    engine = LLMEngine.from_engine_args(args)
    fit = StepCostFit((1,), (0.01,), (1,), (0.0,), 0.0, 0.0, 0.0, FitQuality(1, 1.0, 0, 0, 0, 0))
    target = calibrated_target(CalibratedCostModel(fit, "tiny", engine.model_config, "float32", 4))
    resolved = resolve_engine_config(target, args)
    assert resolved.scheduler_config == engine.config.scheduler_config
    if "num_gpu_blocks_override" in fields or "kv_cache_memory_bytes" in fields:
        assert resolved.cache_config == engine.config.cache_config
    else:
        # The engine's CPU default budget is also capped at half of the free RAM of the
        # machine it runs on; the simulator takes the fixed default.
        assert resolved.cache_config.block_size == engine.config.cache_config.block_size
