"""The simulator resolves engine arguments through the engine's own resolver: the same
EngineConfig for the same arguments and facts (a check that it passes its facts through)."""

from __future__ import annotations

import dataclasses

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm.config.engine_args import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sim.calibrated import CalibratedCostModel, FitQuality, StepCostFit
from pagellm.sim.target import calibrated_target, resolve_engine_config
from pagellm.sim.runs import target_from_args
from pagellm.entrypoints.cli import build_parser


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-target"), "llama", seed=2))


def cpu_target(engine: LLMEngine):
    fit = StepCostFit((1,), (0.01,), (1,), (0.0,), 0.0, 0.0, 0.0, FitQuality(1, 1.0, 0, 0, 0, 0))
    return calibrated_target(CalibratedCostModel(fit, "tiny", engine.model_config, "float32", 4))


@pytest.mark.parametrize("fields", [
    {},
    {"max_model_len": 256, "max_num_seqs": 7, "max_num_batched_tokens": 100, "block_size": 8},
    {"max_model_len": 128, "enable_chunked_prefill": False, "num_gpu_blocks_override": 40},
    {"max_model_len": 256, "kv_cache_memory_bytes": 1 << 20, "preemption_mode": "swap", "swap_space": 0.01},
    {"max_model_len": 256, "profile": "interactive"},
    {"max_model_len": 256, "prefill_share": 0.5, "max_num_partial_prefills": 2,
     "long_prefill_token_threshold": 64, "scheduling_policy": "shortest-remaining"},
])  # fmt: skip
def test_same_engine_config_as_the_engine(tiny_model, fields):
    args = EngineArgs(model=tiny_model, dtype="float32", disable_log_stats=True, **fields)
    engine = LLMEngine.from_engine_args(args)
    try:
        resolved = resolve_engine_config(cpu_target(engine), args).engine_config
    finally:
        engine.close()
    # The simulator knows the shapes, not the files.
    resolved = dataclasses.replace(resolved, source=engine.config.source)
    if "num_gpu_blocks_override" in fields or "kv_cache_memory_bytes" in fields:
        assert resolved == engine.config
    else:
        # The engine's CPU default budget is also capped at half of the free RAM of the
        # machine it runs on; the simulator takes the fixed default.
        assert dataclasses.replace(resolved, cache_config=engine.config.cache_config) == engine.config


def test_a_sliding_window_model_gets_one_answer(tmp_path):
    """A Mistral-style checkpoint with 4096 positions and a 64-token window: the engine
    and `pagellm simulate --model` on the same folder plan the same max_model_len (the
    model's context: the window limits attention, not the length)."""
    folder = make_tiny_hf_checkpoint(tmp_path, "mistral", seed=1, max_position_embeddings=4096, sliding_window=64)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(folder), dtype="float32", disable_log_stats=True))
    engine_len = engine.config.max_model_len
    engine.close()
    args = build_parser().parse_args(["simulate", "--model", str(folder), "--gpu", "H100-SXM"])
    target = target_from_args(args)
    assert resolve_engine_config(target, EngineArgs()).scheduler_config.max_model_len == engine_len == 4096
