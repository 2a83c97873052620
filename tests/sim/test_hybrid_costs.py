"""A hybrid's costs by hand: attention and the KV cache only in its attending layers; its
linear-attention layers' projections, recurrence and per-request state in the roofline,
the live MFU/MBU and the simulated KV capacity (the state slots and snapshots come off
the same budget as in the engine)."""

from __future__ import annotations

import dataclasses

import pytest

from pagellm.config.cache import CacheBudget, MemoryFacts, kv_bytes_per_block
from pagellm.config.model import LinearAttentionSpec, ModelConfig
from pagellm.config.parallel import rank_model_config, tp_split_error
from pagellm.core.step_batch import StepBatch
from pagellm.metrics.utilization import step_cost
from pagellm.model.costs import ModelCosts
from pagellm.sim.gpu_presets import GpuSpec
from pagellm.sim.kv_capacity import simulated_cache_size
from pagellm.sim.roofline import RooflineCostModel, RooflineParams

# Four layers, the last one attending: hidden 8, 2 heads of 4 (q 8) gated, 1 KV head (kv 4),
# MLP 16, vocabulary 10. Linear attention: 2 key heads of 2, 4 value heads of 3, conv 4.
SPEC = LinearAttentionSpec(layers=(0, 1, 2), num_key_heads=2, num_value_heads=4, key_head_dim=2, value_head_dim=3)
HYBRID = ModelConfig(
    architecture="Qwen3_5ForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
    linear_attention=SPEC, attention_output_gate=True, norm_weight_offset=True, qk_norm=True,
)  # fmt: skip
# conv channels 2*2*2 + 4*3 = 20; value width 12.
# Attending layer: q with its gate 8*(8+8) + k, v 8*(4+4) + o 8*8 = 128 + 64 + 64 = 256.
# Linear layer: in_proj 8*(20 + 12 + 2*4) = 320, out_proj 12*8 = 96 -> 416; three of them 1248.
# MLPs: 4 x 3*8*16 = 1536. Matmul weights: 256 + 1248 + 1536 = 3040.
MATMUL_WEIGHTS = 3040
# Recurrence per token and linear layer: 7 x 4 value heads x 2 x 3 = 168, conv 2 x 4 x 20 = 160.
RECURRENT_FLOPS = 3 * (168 + 160)
# State per request: 3 layers x (conv 20 x 3 + recurrent 4 x 2 x 3 = 84) x 4 bytes.
STATE_BYTES = 3 * 84 * 4


def test_costs_by_hand():
    costs = ModelCosts.from_config(HYBRID, dtype_bytes=2)
    assert costs.linear_flops_per_token == 2 * MATMUL_WEIGHTS
    assert costs.linear_weight_bytes == 2 * MATMUL_WEIGHTS
    assert costs.attention_flops_per_pair == 4 * 1 * 2 * 4  # one attending layer
    assert costs.kv_bytes_per_token == 2 * 1 * 4 * 2 == kv_bytes_per_block(HYBRID, 1, "bfloat16")
    assert costs.recurrent_flops_per_token == RECURRENT_FLOPS
    assert costs.state_bytes_per_request == STATE_BYTES == HYBRID.state_bytes_per_request()
    # The matmuls, the LM head (tied: the embedding) and the small parameters are the model:
    # norms 4 x 2 x 8 + 8, q/k norms 2 x 4, convs 3 x 20 x 4, A_log and dt_bias 3 x 2 x 4,
    # gated norms 3 x 3.
    assert HYBRID.num_parameters() - MATMUL_WEIGHTS - 10 * 8 == 72 + 8 + 240 + 24 + 9


def test_roofline_charges_the_recurrence_and_the_state_traffic():
    gpu = GpuSpec("toy", peak_tflops=1e-9, memory_bandwidth_gbs=1e-7, memory_gib=1, host_link_gbs=1e-8, source="test")
    model = RooflineCostModel("toy", ModelCosts.from_config(HYBRID, 2), gpu, RooflineParams(1.0, 1.0, 0.0))
    # Three decodes: 3 x 984 recurrent FLOP = 2.952 s at 1000 FLOP/s, against 3 requests'
    # state read and written, 3 x 2 x 1008 bytes = 60.48 s at 100 bytes/s: memory-bound.
    decode = model.breakdown(StepBatch((), (), (5, 9, 20), num_sampled_tokens=3))
    assert decode.recurrent_s == pytest.approx(3 * 2 * STATE_BYTES / 100)
    # One prefill of 500 tokens: 500 x 984 FLOP = 492 s, one state's traffic 20.16 s.
    prefill = model.breakdown(StepBatch((500,), (0,), (), num_sampled_tokens=1))
    assert prefill.recurrent_s == pytest.approx(500 * RECURRENT_FLOPS / 1000)
    assert prefill.total_s == pytest.approx(sum(prefill[:5]) + prefill.comm_s + prefill.recurrent_s)
    # A model without linear attention has none.
    dense = dataclasses.replace(HYBRID, linear_attention=None, attention_output_gate=False)
    assert RooflineCostModel("d", ModelCosts.from_config(dense, 2), gpu).breakdown(StepBatch((), (), (5,), 1)).recurrent_s == 0


def test_live_utilization_counts_the_state():
    costs = ModelCosts.from_config(HYBRID, 2)
    batch = StepBatch((), (), (5, 9), num_sampled_tokens=2)
    without = dataclasses.replace(costs, recurrent_flops_per_token=0.0, state_bytes_per_request=0.0)
    assert step_cost(costs, batch).flops - step_cost(without, batch).flops == 2 * RECURRENT_FLOPS
    assert step_cost(costs, batch).bytes - step_cost(without, batch).bytes == 2 * 2 * STATE_BYTES


def test_simulated_capacity_takes_the_state_slots_and_snapshots_off_the_budget():
    budget = CacheBudget(gpu_memory_utilization=0.5, block_size=16)
    memory = MemoryFacts(device_total_bytes=10_000_000, used_bytes=1_000_000, used_how="test")
    block = kv_bytes_per_block(HYBRID, 16, "bfloat16")
    plain = simulated_cache_size(HYBRID, "bfloat16", budget, memory)
    with_state = simulated_cache_size(HYBRID, "bfloat16", budget, memory, states_per_seat=2, max_seats=256)
    assert with_state.num_state_slots == 256
    assert plain.num_gpu_blocks - with_state.num_gpu_blocks == pytest.approx(512 * STATE_BYTES / block, abs=1)


def test_tensor_parallelism_splits_whole_key_heads_and_their_value_heads():
    assert tp_split_error(HYBRID, 2) is None
    share = rank_model_config(HYBRID, 2).linear_attention
    assert (share.num_key_heads, share.num_value_heads) == (1, 2)
    wide = dataclasses.replace(HYBRID, num_attention_heads=4, num_key_value_heads=4, intermediate_size=16)
    assert "key heads do not split over TP=4" in tp_split_error(wide, 4)


# --- the hybrid presets -----------------------------------------------------------------


def test_hybrid_presets_match_their_names_and_state_by_hand():
    from pagellm.sim.model_presets import get_model_preset

    dense, moe, following = (get_model_preset(n).config for n in ("Qwen3.5-27B", "Qwen3.5-35B-A3B", "Qwen3-Next-80B-A3B"))
    assert dense.num_parameters() == pytest.approx(27e9, rel=0.01)
    assert moe.num_parameters() == pytest.approx(35e9, rel=0.015) and following.num_parameters() == pytest.approx(80e9, rel=0.01)
    for config in (moe, following):  # the "A3B": the projections a token uses, the embedding and the head
        costs = ModelCosts.from_config(config, 2)
        assert 3e9 < costs.linear_flops_per_token / 2 + 2 * config.vocab_size * config.hidden_size < 4e9
    # Qwen3.5-27B: 48 Gated DeltaNets, each holding per request the conv's last 3 inputs of
    # 2 x 16 x 128 + 48 x 128 = 10240 channels and 48 value heads' 128 x 128 state, float32.
    assert dense.state_bytes_per_request() == 48 * (3 * 10240 + 48 * 128 * 128) * 4
    # ... and 16 attending layers' K and V: 2 x 16 x 4 heads x 256 x 2 bytes per token.
    assert ModelCosts.from_config(dense, 2).kv_bytes_per_token == 2 * 16 * 4 * 256 * 2


def test_simulated_engine_sizes_the_cache_after_one_slot_and_snapshot_per_seat():
    from pagellm import EngineArgs
    from pagellm.sim.gpu_presets import get_gpu_preset
    from pagellm.sim.model_presets import get_model_preset
    from pagellm.sim.target import resolve_engine_config, roofline_target

    target = roofline_target("Qwen3.5-35B-A3B", get_gpu_preset("H200"), RooflineParams())
    state = get_model_preset("Qwen3.5-35B-A3B").config.state_bytes_per_request()
    block = ModelCosts.from_config(target.model_config, 2).kv_bytes_per_block(16)
    few, many = (resolve_engine_config(target, EngineArgs(max_num_seqs=n)).kv for n in (32, 64))
    # 32 more seats: 32 more slots and snapshots, and 32 more rows of float32 logits at peak.
    logits = 32 * target.model_config.vocab_size * 4
    assert few.num_gpu_blocks - many.num_gpu_blocks == pytest.approx((2 * 32 * state + logits) / block, abs=1)
    assert "of recurrent states for 64 requests" in many.how and many.num_state_slots == 64
    # 256 seats' states would take more than half of what an H100 has left next to the
    # weights: the seats are cut to what half of it holds, and the engine runs that many.
    h100 = roofline_target("Qwen3.5-35B-A3B", get_gpu_preset("H100-SXM"), RooflineParams())
    resolved = resolve_engine_config(h100, EngineArgs(max_num_seqs=256, max_model_len=32768))
    seats = resolved.kv.num_state_slots
    assert 0 < seats < 256 and "(not 256: more would take over 50% of the budget)" in resolved.kv.how
    assert resolved.engine_config.scheduler_config.max_num_seqs == resolved.cache_config.num_state_slots == seats
    assert resolved.cache_config.num_state_snapshots == seats
    budget = (resolved.kv.num_gpu_blocks - 1) * block + 2 * seats * state  # the KV and the states: the whole budget
    assert 2 * seats * state <= 0.5 * budget < 2 * (seats + 1) * state + block
