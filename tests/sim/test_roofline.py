"""The roofline cost model against hand-computed steps."""

from __future__ import annotations

import pytest

from pagellm.errors import ConfigError
from pagellm.config.model import ModelConfig
from pagellm.sim.gpu_presets import GpuSpec, get_gpu_preset
from pagellm.model.costs import ModelCosts
from pagellm.sim.model_presets import get_model_preset
from pagellm.sim.roofline import RooflineCostModel, RooflineParams
from pagellm.core.step_batch import StepBatch

# A toy model: hidden 4, 2 heads of 2 (q width 4), 1 KV head (kv width 2), MLP 8, one
# layer, vocabulary 10. Per layer: qkv 4*(4+2*2) = 32, o 4*4 = 16, MLP 3*4*8 = 96, so
# 144 matmul weights; the LM head has 10*4 = 40.
TOY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=8,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
    rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip
# 1000 FLOP/s and 100 bytes/s: numbers small enough to follow by hand.
TOY_GPU = GpuSpec("toy", peak_tflops=1e-9, memory_bandwidth_gbs=1e-7, memory_gib=1, host_link_gbs=1e-8, source="test")
EXACT = RooflineParams(compute_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.5)


def toy_model(params: RooflineParams = EXACT) -> RooflineCostModel:
    return RooflineCostModel("toy", ModelCosts.from_config(TOY, dtype_bytes=2), TOY_GPU, params)


def test_toy_costs_by_hand():
    costs = ModelCosts.from_config(TOY, dtype_bytes=2)
    assert costs.linear_flops_per_token == 2 * 144
    assert costs.linear_weight_bytes == 2 * 144
    assert costs.lm_head_flops_per_row == 2 * 40 and costs.lm_head_weight_bytes == 80
    assert costs.attention_flops_per_pair == 4 * 1 * 2 * 2  # 2 MACs x (QK, PV) x heads x dim
    assert costs.kv_bytes_per_token == 2 * 1 * 2 * 2  # K and V x layers x kv width x bytes
    assert costs.kv_bytes_per_block(16) == 128


def test_one_decode_is_memory_bound():
    # 1 token: matmuls 288 FLOP = 0.288 s vs 288 weight bytes = 2.88 s -> 2.88.
    # Attention: context 9 -> 10 pairs x 16 FLOP = 0.16 s vs (9 read + 1 written) x 8
    # bytes = 0.8 s -> 0.8. LM head: 80 FLOP = 0.08 s vs 80 bytes = 0.8 s -> 0.8.
    # Plus 0.5 s overhead.
    step = toy_model().breakdown(StepBatch((), (), (9,), num_sampled_tokens=1))
    assert step.linear_s == pytest.approx(2.88)
    assert step.attention_s == pytest.approx(0.8)
    assert step.lm_head_s == pytest.approx(0.8)
    assert step.memory_bound
    assert step.total_s == pytest.approx(2.88 + 0.8 + 0.8 + 0.5)


def test_a_long_prefill_is_compute_bound():
    # 100 tokens, no context, a partial chunk (nothing sampled): matmuls 28800 FLOP =
    # 28.8 s vs 2.88 s of weights. Pairs 100*101/2 = 5050 x 16 = 80800 FLOP = 80.8 s vs
    # 100 tokens x 8 bytes written = 8 s. No LM head.
    model = toy_model()
    step = model.breakdown(StepBatch((100,), (0,), (), num_sampled_tokens=0))
    assert step.linear_s == pytest.approx(28.8)
    assert step.attention_s == pytest.approx(80.8)
    assert step.lm_head_s == 0.0 and not step.memory_bound
    assert model.predict(StepBatch((100,), (0,), ())) == pytest.approx(28.8 + 80.8 + 0.5)


def test_efficiencies_scale_the_peaks_and_swaps_use_the_host_link():
    half = RooflineParams(compute_efficiency=0.5, bandwidth_efficiency=0.25, step_overhead_s=0.0)
    step = toy_model(half).breakdown(StepBatch((), (), (9,), num_sampled_tokens=1, num_swapped_tokens=16))
    assert step.linear_s == pytest.approx(2.88 / 0.25)
    assert step.lm_head_s == pytest.approx(0.8 / 0.25)
    # 16 tokens x 8 bytes over 10 bytes/s.
    assert step.swap_s == pytest.approx(12.8)


def test_llama3_8b_decode_on_h100_by_hand():
    # 32 layers x (4096*(4096+2*1024) + 4096*4096 + 3*4096*14336) = 6,979,321,856 matmul
    # weights, 128256*4096 = 525,336,576 in the LM head; bf16. At 80% of 3.35 TB/s one
    # decode reads (6,979,321,856 + 525,336,576) * 2 bytes; its context of 1000 tokens
    # adds 1001 * 2*32*8*128*2 bytes of KV; plus 1 ms.
    model = RooflineCostModel(
        "Llama-3-8B", ModelCosts.from_config(get_model_preset("Llama-3-8B").config, 2),
        get_gpu_preset("H100-SXM"), RooflineParams(),
    )  # fmt: skip
    bandwidth = 3.35e12 * 0.8
    expected = ((6_979_321_856 + 525_336_576) * 2 + 1001 * 131072) / bandwidth + 0.001
    assert model.predict(StepBatch((), (), (1000,), num_sampled_tokens=1)) == pytest.approx(expected)
    # 4096 prefill tokens are compute-bound: 2 FLOPs per weight per token at 70% of 989 TFLOP/s.
    big = model.breakdown(StepBatch((4096,), (0,), (), num_sampled_tokens=1))
    assert big.linear_s == pytest.approx(4096 * 2 * 6_979_321_856 / (989e12 * 0.7))
    assert not big.memory_bound


@pytest.mark.parametrize("field,value", [("compute_efficiency", 0.0), ("bandwidth_efficiency", 1.5), ("step_overhead_s", -1.0)])
def test_bad_params_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        RooflineParams(**{field: value})


def test_sliding_layers_read_only_their_window():
    """Gemma-3-27B decoding at 32k context: its 52 sliding layers read 1023 cached tokens,
    the 10 global ones all 32000; the KV bytes read are that mix, not 62 layers of 32000."""
    config = get_model_preset("Gemma-3-27B").config
    costs = ModelCosts.from_config(config, dtype_bytes=2)
    assert dict(costs.layer_windows) == pytest.approx({None: 10 / 62, 1024: 52 / 62})
    gpu = GpuSpec("toy", peak_tflops=1e6, memory_bandwidth_gbs=1.0, memory_gib=1, host_link_gbs=1.0, source="test")
    model = RooflineCostModel("gemma", costs, gpu, EXACT)
    step = model.breakdown(StepBatch((), (), (32000,), num_sampled_tokens=1))
    read = (10 / 62 * 32000 + 52 / 62 * 1023 + 1) * costs.kv_bytes_per_token
    assert step.attention_s == pytest.approx(read / 1e9)
    full = RooflineCostModel("full", ModelCosts.from_config(TOY, 2), gpu, EXACT)  # a model with no windows: all of it
    assert full.breakdown(StepBatch((), (), (32000,), num_sampled_tokens=1)).attention_s == pytest.approx(
        32001 * ModelCosts.from_config(TOY, 2).kv_bytes_per_token / 1e9
    )
