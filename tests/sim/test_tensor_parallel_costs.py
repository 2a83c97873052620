"""Tensor parallelism in the roofline model: one GPU's share, the all-reduces, by hand."""

from __future__ import annotations

import pytest

from pagellm.errors import ConfigError
from pagellm.config.model import ModelConfig
from pagellm.config.parallel import kv_heads_per_rank, rank_model_config
from pagellm.model.costs import ModelCosts
from pagellm.sim.gpu_presets import GpuSpec, get_gpu_preset
from pagellm.sim.interconnect_presets import InterconnectSpec, get_interconnect_preset
from pagellm.sim.model_presets import get_model_preset
from pagellm.sim.roofline import RooflineCostModel, RooflineParams
from pagellm.sim.target import roofline_target
from pagellm.core.step_batch import StepBatch
from pagellm.sim.tensor_parallel_costs import (
    TensorParallelComm,
    TensorParallelLink,
    rank_costs,
    ring_all_reduce_seconds,
    ring_gather_seconds,
    tp_split_error,
)

# hidden 8, 4 query heads and 2 KV heads of 2, MLP 16, 2 layers, vocabulary 10. Per
# layer: qkv 8*(8+2*4) = 128, o 8*8 = 64, MLP 3*8*16 = 384: 576 matmul weights.
TOY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
    rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip
# 1000 FLOP/s and 100 bytes/s; a link of 100 bytes/s per direction.
TOY_GPU = GpuSpec("toy", peak_tflops=1e-9, memory_bandwidth_gbs=1e-7, memory_gib=1, host_link_gbs=1e-8, source="test")
TOY_LINK = InterconnectSpec("toy-link", bidirectional_gbs=2e-7, latency_us=0.0, source="test")
EXACT = RooflineParams(compute_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.0)
LLAMA_70B = get_model_preset("Llama-3-70B").config


def test_ring_all_reduce_formula():
    # 2 * (n-1)/n of the buffer over the per-direction bandwidth, plus alpha.
    assert ring_all_reduce_seconds(1e6, 4, 1e9, 5e-6) == pytest.approx(2 * 3 / 4 * 1e6 / 1e9 + 5e-6)
    assert ring_all_reduce_seconds(1e6, 2, 1e9, 0.0) == pytest.approx(1e-3)
    assert ring_all_reduce_seconds(1e6, 8, 1e9, 0.0) == pytest.approx(1.75e-3)
    assert ring_all_reduce_seconds(1e6, 1, 1e9, 5e-6) == 0.0  # no group, no collective
    assert ring_gather_seconds(8e5, 8, 1e9, 1e-6) == pytest.approx(7 / 8 * 8e5 / 1e9 + 1e-6)


def test_weights_and_flops_are_divided_by_tp():
    full = ModelCosts.from_config(TOY, 2)
    half = rank_costs(TOY, 2, 2)  # 2 query heads, 1 KV head, MLP 8, vocabulary 5
    assert full.linear_weight_bytes == 2 * 2 * 576
    assert half.linear_weight_bytes == full.linear_weight_bytes / 2
    assert half.linear_flops_per_token == full.linear_flops_per_token / 2
    assert half.lm_head_weight_bytes == full.lm_head_weight_bytes / 2 == 5 * 8 * 2
    assert half.attention_flops_per_pair == full.attention_flops_per_pair / 2
    assert half.kv_bytes_per_token == full.kv_bytes_per_token / 2
    # The real 70B splits evenly 8 ways: 68,451,041,280 matmul weights, 128256 x 8192 head.
    costs = rank_costs(LLAMA_70B, 2, 8)
    assert costs.linear_weight_bytes == 68_451_041_280 * 2 / 8
    assert costs.lm_head_weight_bytes == 128256 * 8192 * 2 / 8
    assert costs.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one KV head of 8 per GPU


def test_kv_heads_are_replicated_when_fewer_than_gpus():
    assert kv_heads_per_rank(8, 4) == 2 and kv_heads_per_rank(8, 8) == 1 and kv_heads_per_rank(2, 4) == 1
    full = ModelCosts.from_config(TOY, 2)
    quarter = rank_costs(TOY, 2, 4)  # 2 KV heads over 4 GPUs: each holds one, twice over
    assert rank_model_config(TOY, 4).num_key_value_heads == 1
    # KV per GPU is 1/2 of the model's, not 1/4: a block costs twice the split's share.
    assert quarter.kv_bytes_per_token == full.kv_bytes_per_token / 2 == 2 * 2 * 1 * 2 * 2
    assert quarter.kv_bytes_per_block(16) == 2 * ModelCosts.from_config(TOY, 2).kv_bytes_per_block(16) / 4
    # k/v projections are replicated too: 8*(2+2*2) + 2*8 + 3*8*4 = 160 per layer, not 576/4 = 144.
    assert quarter.linear_weight_bytes == 2 * 2 * 160 > full.linear_weight_bytes / 4
    # Query heads still split 4 ways.
    assert quarter.attention_flops_per_pair == full.attention_flops_per_pair / 4
    # Vocabulary 10 padded to 12: 3 rows per GPU.
    assert quarter.lm_head_weight_bytes == 3 * 8 * 2


@pytest.mark.parametrize("config,tp,fragment", [
    (TOY, 3, "num_attention_heads=4 does not split over TP=3"),
    (get_model_preset("Qwen2.5-7B").config, 8, "num_attention_heads=28 does not split over TP=8"),
    (get_model_preset("SmolLM2-135M").config, 2, "num_attention_heads=9 does not split over TP=2"),
    (ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=12, intermediate_size=12,
                 num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3, head_dim=2,
                 rms_norm_eps=1e-5), 2, "num_key_value_heads=3 neither splits over nor replicates"),
    (LLAMA_70B, 16, "spans more than one node of 8 GPUs"),
])  # fmt: skip
def test_splits_that_do_not_work_are_named(config, tp, fragment):
    error = tp_split_error(config, tp)
    assert error is not None and fragment in error
    with pytest.raises(ConfigError, match=fragment.split(" ")[0]):
        rank_costs(config, 2, tp)


def test_splits_that_work():
    assert [tp for tp in range(1, 9) if tp_split_error(LLAMA_70B, tp) is None] == [1, 2, 4, 8]
    assert tp_split_error(TOY, 4) is None  # replicated KV heads are allowed


def test_all_reduce_time_per_step_by_hand():
    # Link: 100 bytes/s per direction x 0.5 = 50 bytes/s, 0.01 s per collective.
    link = TensorParallelLink(4, TOY_LINK, allreduce_efficiency=0.5, allreduce_latency_s=0.01)
    comm = TensorParallelComm(TOY, 2, link)
    assert comm.num_all_reduces == 2 * 2 + 1  # two per layer, one after the embedding
    # 3 tokens x 8 x 2 bytes = 48 bytes: 2 * 3/4 * 48 / 50 = 1.44 s, + 0.01.
    assert comm.all_reduce_seconds(3) == pytest.approx(5 * (1.44 + 0.01))
    # One sampled row: the padded 12-entry vocabulary x 2 bytes, 3/4 of it over the link.
    assert comm.gather_seconds(1) == pytest.approx(3 / 4 * 24 / 50 + 0.01)
    assert comm.seconds(0, 0) == 0.0
    model = RooflineCostModel("toy", rank_costs(TOY, 2, 4), TOY_GPU, EXACT, comm)
    step = model.breakdown(StepBatch((), (), (9, 9, 9), num_sampled_tokens=3))
    assert step.comm_s == pytest.approx(5 * 1.45 + 3 * 0.36 + 0.01)
    assert step.total_s == pytest.approx(step.linear_s + step.attention_s + step.lm_head_s + step.comm_s)
    assert model.name == "roofline: toy on toy, TP=4 over toy-link"


def test_llama3_70b_decode_at_tp8_on_h100_by_hand():
    h100 = get_gpu_preset("H100-SXM")
    nvlink = get_interconnect_preset("NVLink4")
    target = roofline_target("Llama-3-70B", h100, RooflineParams(), TensorParallelLink(8, nvlink))
    # Per GPU: 1/8 of 68,451,041,280 matmul weights and 1,050,673,152 LM-head weights in
    # bf16 at 80% of 3.35 TB/s; 1001 tokens of one KV head (40,960 bytes each); 1 ms.
    memory_s = ((68_451_041_280 + 1_050_673_152) / 8 * 2 + 1001 * 40_960) / (3.35e12 * 0.8)
    # 161 all-reduces of 8192 x 2 bytes, each 2 * 7/8 of it over 450 GB/s x 0.8, + 10 us;
    # the gather of one row of 128256 bf16 logits, 7/8 of it over the link, + 10 us.
    comm_s = 161 * (2 * 7 / 8 * 8192 * 2 / 360e9 + 10e-6) + (7 / 8 * 128256 * 2 / 360e9 + 10e-6)
    step = target.cost_model.breakdown(StepBatch((), (), (1000,), num_sampled_tokens=1))  # type: ignore[attr-defined]
    assert step.comm_s == pytest.approx(comm_s)
    assert step.total_s == pytest.approx(memory_s + 0.001 + comm_s)
    # The same decode at TP=1 reads 8x the weights and has no collectives.
    single = roofline_target("Llama-3-70B", h100, RooflineParams())
    single_s = single.cost_model.predict(StepBatch((), (), (1000,), num_sampled_tokens=1))
    assert single_s == pytest.approx(((68_451_041_280 + 1_050_673_152) * 2 + 1001 * 327_680) / (3.35e12 * 0.8) + 0.001)
    assert step.total_s < single_s / 5


def test_tp1_is_the_single_gpu_model_exactly():
    h100 = get_gpu_preset("H100-SXM")
    plain = roofline_target("Llama-3-8B", h100, RooflineParams())
    one = roofline_target("Llama-3-8B", h100, RooflineParams(), TensorParallelLink(1, get_interconnect_preset("NVLink4")))
    assert one.tensor_parallel is None and one.costs == plain.costs
    assert one.cost_model.name == plain.cost_model.name == "roofline: Llama-3-8B on H100-SXM"
    for batch in (StepBatch((), (), (1000,), 1), StepBatch((4096,), (0,), (), 1), StepBatch((100,), (50,), (7, 9), 3)):
        assert one.cost_model.predict(batch) == plain.cost_model.predict(batch)


def test_link_parameters_are_checked():
    nvlink = get_interconnect_preset("nvlink4")
    assert TensorParallelLink(2, nvlink).latency_s == pytest.approx(10e-6)
    assert TensorParallelLink(2, nvlink, allreduce_latency_s=0.0).latency_s == 0.0
    assert TensorParallelLink(2, nvlink).bandwidth == pytest.approx(450e9 * 0.8)
    with pytest.raises(ConfigError, match="--allreduce-efficiency"):
        TensorParallelLink(2, nvlink, allreduce_efficiency=1.5)
    with pytest.raises(ConfigError, match="--allreduce-latency-us"):
        TensorParallelLink(2, nvlink, allreduce_latency_s=-1.0)
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        TensorParallelLink(0, nvlink)
