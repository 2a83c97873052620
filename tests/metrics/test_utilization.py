"""MFU / MBU estimates on hand-computed steps."""

import pytest

from pagellm.core.step_batch import StepBatch
from pagellm.metrics.utilization import Ceilings, Utilization, step_cost, utilization
from pagellm.model.costs import ModelCosts
from pagellm.config.model import ModelConfig


def tiny_config(**overrides):
    shape = dict(
        architecture="LlamaForCausalLM", rms_norm_eps=1e-5, vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=64,
    )  # fmt: skip
    shape.update(overrides)
    return ModelConfig(**shape)


def test_model_cost_by_hand():
    cost = ModelCosts.from_config(tiny_config(), dtype_bytes=2)
    # Per layer: qkv 8x(8+4+4)=128, o 8x8=64, gate/up/down 3x8x16=384 -> 576 params.
    assert cost.linear_flops_per_token == 2 * 2 * 576
    assert cost.attention_flops_per_pair == 4 * 2 * 8  # 2 layers, 2 heads x 4 dims
    assert cost.lm_head_flops_per_row == 2 * 8 * 100
    assert cost.step_weight_bytes == (2 * 576 + 8 * 100) * 2
    assert cost.kv_bytes_per_token == 2 * 2 * 4 * 2  # K and V, 2 layers, 1 kv head x 4, bf16


def test_step_work_counts_causal_pairs():
    # A 3-token chunk ending a 10-token context sees 8, 9 and 10 positions; a decode at
    # context 5 sees 5; a whole 4-token prompt sees 1+2+3+4.
    work = StepBatch.from_lengths([3, 1, 4], [10, 5, 4], num_sampled_tokens=3)
    assert (work.num_tokens, work.num_sampled_tokens, work.attention_pairs, work.context_tokens) == (8, 3, 27 + 5 + 10, 19)


def test_step_cost_and_utilization_by_hand():
    cost = ModelCosts(
        linear_flops_per_token=100.0, linear_weight_bytes=600.0, lm_head_flops_per_row=50.0,
        lm_head_weight_bytes=400.0, attention_flops_per_pair=2.0, kv_bytes_per_token=10.0, weight_bytes=1e9,
    )  # fmt: skip
    # A 4-token chunk over 5 cached tokens: 4 tokens, 5*4 + 10 = 30 pairs, 9 context tokens.
    work = StepBatch(prefill_num_tokens=(4,), prefill_context_lens=(5,), num_sampled_tokens=2)
    step = step_cost(cost, work)
    assert step.flops == 400 + 60 + 100
    assert step.bytes == 1000 + 10 * (9 + 4)
    result = utilization(step, seconds=2.0, ceilings=Ceilings(flops_per_s=1000.0, bytes_per_s=340.0, source="test"))
    assert result.mfu == pytest.approx(560 / 2 / 1000)
    assert result.mbu == pytest.approx(1130 / 2 / 340)
    assert result.bound == "memory"
    assert result.describe() == "bound: memory 166% / compute 28%"


def test_decode_of_a_real_shape_is_memory_bound_and_a_big_batch_is_not():
    # Llama-3-8B shape, bf16, on an H100-like device (989 TFLOP/s, 3.35 TB/s).
    config = tiny_config(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
    )  # fmt: skip
    cost = ModelCosts.from_config(config, dtype_bytes=2)
    ceilings = Ceilings(989e12, 3.35e12, "preset")
    one = step_cost(cost, StepBatch.from_lengths([1], [512], 1))
    # One token: ~16 GB of weights dominate; a step at the bandwidth roofline is ~4.8 ms.
    at_roofline = one.bytes / ceilings.bytes_per_s
    small = utilization(one, at_roofline, ceilings)
    assert small.bound == "memory" and small.mbu == pytest.approx(1.0) and small.mfu < 0.01
    big = step_cost(cost, StepBatch.from_lengths([2048] * 4, [2048] * 4, 4))
    large = utilization(big, big.flops / ceilings.flops_per_s, ceilings)
    assert large.bound == "compute" and large.mfu == pytest.approx(1.0)


def test_hints():
    assert "raise max_num_seqs" in Utilization(mfu=0.1, mbu=0.8).hint(num_running=8, num_waiting=3, max_num_seqs=256)
    assert "more concurrent requests" in Utilization(mfu=0.1, mbu=0.8).hint(num_running=2, num_waiting=0, max_num_seqs=256)
    assert "compute-bound" in Utilization(mfu=0.7, mbu=0.2).hint(num_running=64, num_waiting=0, max_num_seqs=256)
    assert Utilization(mfu=0.2, mbu=0.3).hint(num_running=4, num_waiting=0, max_num_seqs=256) is None


def test_ceilings_measured_on_a_busy_machine_are_flagged(monkeypatch, caplog):
    import logging

    import torch

    from pagellm.metrics import ceilings

    monkeypatch.delenv("PAGELLM_DEVICE_CEILINGS", raising=False)
    monkeypatch.setattr(ceilings, "model_matmul_ceiling", lambda *args, **kwargs: 100.0)
    monkeypatch.setattr(ceilings, "measure_bandwidth", lambda *args, **kwargs: 1e10)
    measure = ceilings.device_ceilings.__wrapped__  # not the per-process cache
    monkeypatch.setattr(ceilings, "others_share", lambda before, after: 0.05)
    assert measure("cpu", torch.bfloat16).source == "measured"
    monkeypatch.setattr(ceilings, "others_share", lambda before, after: 0.8)
    with caplog.at_level(logging.WARNING, logger="pagellm.metrics.ceilings"):
        busy = measure("cpu", torch.bfloat16)
    assert busy.source == "measured under load" and busy.flops_per_s == 100e9
    assert any("other processes used 80% of the CPUs" in r.getMessage() for r in caplog.records)
