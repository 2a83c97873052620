"""Tensor and data parallelism through `pagellm simulate`: KV capacity per GPU, the
"does not fit" error, data-parallel replicas, TP=1 unchanged, and the flags."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.config.engine_args import EngineArgs
from pagellm.entrypoints.cli import build_parser, main
from pagellm.errors import ConfigError
from pagellm.config.model import ModelConfig
from pagellm.sim.gpu_presets import GiB, GpuSpec, get_gpu_preset
from pagellm.sim.interconnect_presets import (
    INTERCONNECT_PRESETS,
    default_interconnect,
    get_interconnect_preset,
)
from pagellm.config.cache import CacheBudget, MemoryFacts
from pagellm.sim.kv_capacity import GPU_RUNTIME_RESERVE_BYTES, simulated_cache_size
from pagellm.sim.model_presets import get_model_preset
from pagellm.sim.data_parallel import merge_kv_samples, run_replicas, split_round_robin
from pagellm.sim.roofline import RooflineParams
from pagellm.sim.runs import simulate, target_from_args
from pagellm.sim.report import summarize_sim
from pagellm.sim.target import resolve_engine_config, roofline_target, target_engine_config, tp_sizes_that_fit
from pagellm.sim.request_stream import SimRequest
from pagellm.sim.simulator import KVSample
from pagellm.sim.tensor_parallel_costs import TensorParallelLink

H100 = get_gpu_preset("H100-SXM")
NVLINK4 = get_interconnect_preset("NVLink4")
LLAMA_70B = get_model_preset("Llama-3-70B").config


class ConstantCost:
    name = "constant"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def predict(self, batch: object) -> float:
        return self.seconds

    def describe(self) -> dict:
        return {"kind": "constant"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- KV capacity per GPU -------------------------------------------------------------


def test_llama3_70b_kv_cache_at_tp4_on_h100_by_hand():
    target = roofline_target("Llama-3-70B", H100, RooflineParams(), TensorParallelLink(4, NVLINK4))
    kv = resolve_engine_config(target, EngineArgs()).kv
    # Per GPU: 80 x (855,638,016 / 4 matmul + 2 x 8192 norm) + 32064 x 8192 x 2
    # (vocab-parallel embedding and head) + 8192 = 17,639,415,808 parameters in bf16.
    weights = 17_639_415_808 * 2
    # Activations of 2048 tokens through a quarter of a layer (MLP 7168, q 2048, kv 256),
    # plus float32 logits of 256 rows over the whole vocabulary (gathered on one GPU).
    activations = 2048 * (2 * 7168 + 2048 + 2 * 256 + 3 * 8192) * 2 + 256 * 128256 * 4
    # A block holds 16 tokens of 2 of the 8 KV heads: 2 x 80 x 2 x 128 x 2 x 16 bytes.
    block = 2 * 80 * 2 * 128 * 2 * 16
    budget = int(80 * GiB * 0.9 - weights - activations - GPU_RUNTIME_RESERVE_BYTES)
    assert kv.num_gpu_blocks == budget // block + 1
    assert "on each of the TP=4 GPUs" in kv.how and "weights 32.86" in kv.how


def test_kv_blocks_per_gpu_follow_the_kv_heads_it_holds():
    # Llama-3-8B has 8 KV heads: at TP=4 each GPU holds two, at TP=8 one, so the same
    # 1 GiB per GPU holds 4x and 8x the blocks of one GPU holding all eight.
    capacity = {}
    for tp in (1, 4, 8):
        link = TensorParallelLink(tp, NVLINK4) if tp > 1 else None
        target = roofline_target("Llama-3-8B", H100, RooflineParams(), link)
        capacity[tp] = resolve_engine_config(target, EngineArgs(kv_cache_memory_bytes=GiB)).cache_config
    assert capacity[1].num_gpu_blocks == 512 + 1
    assert capacity[4].num_gpu_blocks == 4 * 512 + 1
    assert capacity[8].num_gpu_blocks == 8 * 512 + 1


def test_replicated_kv_heads_add_no_capacity():
    # 2 KV heads: at TP=2 each GPU holds one; at TP=4 each still holds one (replicated
    # twice), so the same bytes per GPU hold the same number of blocks, not twice as many.
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                         rms_norm_eps=1e-5)  # fmt: skip
    blocks = {}
    for tp in (1, 2, 4):
        budget = CacheBudget(block_size=16, kv_cache_memory_bytes=1 << 20)
        blocks[tp] = simulated_cache_size(config, "bfloat16", budget, MemoryFacts(), tp).num_gpu_blocks
    # A block: K and V x 2 layers x heads held x 8 x 2 bytes x 16 tokens.
    assert blocks[1] == (1 << 20) // (2 * 2 * 2 * 8 * 2 * 16) + 1 == 513
    assert blocks[2] == blocks[4] == (1 << 20) // (2 * 2 * 1 * 8 * 2 * 16) + 1 == 1025


def test_a_model_too_big_for_one_gpu_names_the_tp_sizes_that_fit(capsys):
    target = roofline_target("Llama-3-70B", H100, RooflineParams())
    with pytest.raises(ConfigError, match=r"no memory left .* it fits with --tensor-parallel-size 2, 4, 8 \(now 1\)"):
        resolve_engine_config(target, EngineArgs())
    code, _, err = run(capsys, "simulate", "--model", "Llama-3-70B", "--gpu", "L4")
    assert code == 1 and "fits with --tensor-parallel-size 8 (now 1)" in err
    # At TP=8 it resolves, with room for 1/8 of the weights per GPU.
    target = roofline_target("Llama-3-70B", H100, RooflineParams(), TensorParallelLink(8, NVLINK4))
    assert resolve_engine_config(target, EngineArgs()).cache_config.max_num_cached_tokens > 1_000_000
    args = EngineArgs(max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256)
    for model, gpu, sizes in (("Llama-3-70B", "A100-40GB", [4, 8]), ("Llama-3-8B", "H100-SXM", [1, 2, 4, 8])):
        target = roofline_target(model, get_gpu_preset(gpu), RooflineParams())
        assert tp_sizes_that_fit(target, target_engine_config(target, args)) == sizes


# --- Data parallelism ----------------------------------------------------------------


def test_round_robin_in_arrival_order():
    requests = [SimRequest(t, [1], 1) for t in (0.3, 0.1, 0.2, 0.0, 0.5)]
    # Arrival order 3, 1, 2, 0, 4.
    assert split_round_robin(requests, 2) == [[3, 2, 4], [1, 0]]
    assert split_round_robin(requests, 3) == [[3, 0], [1, 4], [2]]
    with pytest.raises(ConfigError, match="--data-parallel-size"):
        split_round_robin(requests, 0)


def test_replicas_serve_in_parallel_by_hand():
    # One request at a time per engine, 1 s per step, two requests of 4 prompt tokens and
    # 3 outputs at 0. One engine: the first finishes at 3, the second starts then and
    # finishes at 6. Two replicas: both finish at 3.
    scheduler = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    cache = CacheConfig(block_size=4, num_gpu_blocks=33)
    requests = [SimRequest(0.0, [1, 2, 3, 4], 3), SimRequest(0.0, [5, 6, 7, 8], 3)]
    one = run_replicas(scheduler, cache, ConstantCost(1.0), requests, 1)
    assert [(r.first_token_s, r.finish_s) for r in one.requests] == [(1.0, 3.0), (4.0, 6.0)]
    two = run_replicas(scheduler, cache, ConstantCost(1.0), requests, 2)
    assert [(r.first_token_s, r.finish_s) for r in two.requests] == [(1.0, 3.0), (1.0, 3.0)]
    assert two.duration_s == 3.0 and two.busy_s == 3.0 and two.num_steps == 6
    assert sorted(two.itl_s) == [1.0] * 4
    assert two.stats.num_prefill_tokens == 8 and two.stats.num_decode_tokens == 4
    # The deployment's KV cache is both replicas' (32 usable blocks each).
    assert two.cache_config.num_usable_gpu_blocks == 64
    s1, s2 = summarize_sim(one), summarize_sim(two)
    assert s1["output_tok_s"] == pytest.approx(1.0) and s2["output_tok_s"] == pytest.approx(2.0)
    assert s2["kv_capacity_tokens"] == 2 * s1["kv_capacity_tokens"] == 256


def test_kv_samples_merge_on_the_coarsest_grid():
    def replica(interval: float, usages: list[float]) -> SimpleNamespace:
        samples = [KVSample(i * interval, u, int(u * 10), 0, 0, 0, 0) for i, u in enumerate(usages)]
        return SimpleNamespace(kv_samples=samples, kv_sample_interval_s=interval)

    merged, interval = merge_kv_samples([replica(0.05, [0.1, 0.2, 0.3, 0.4]), replica(0.1, [0.5, 0.6, 0.7])])
    assert interval == 0.1
    # k=0: 0.1 and 0.5; k=1: 0.3 (every other sample of the finer replica) and 0.6;
    # k=2: the first replica has finished (empty), the second 0.7.
    assert [round(s.usage, 6) for s in merged] == [0.3, 0.45, 0.35]
    assert [s.num_running for s in merged] == [6, 9, 7]


def test_data_parallel_roofline_run():
    target = roofline_target("Llama-3-8B", H100, RooflineParams())
    requests = [SimRequest(0.0, list(range(i, i + 200)), 100) for i in range(64)]
    args = EngineArgs(max_num_seqs=16)
    one = simulate(target, args, requests, 1).summary
    two = simulate(target, args, requests, 2).summary
    assert one["completed"] == two["completed"] == 64
    # 16 running at a time: two replicas run 32, and a decode step of 16 costs about the
    # same as one of 8 (memory-bound), so the whole takes about half the time.
    assert two["duration_s"] < 0.6 * one["duration_s"]
    assert two["kv_capacity_tokens"] == 2 * one["kv_capacity_tokens"]
    with pytest.raises(ConfigError, match="--data-parallel-size must be at least 1"):
        simulate(target, args, requests, 0)


# --- TP=1 unchanged, and the flags ---------------------------------------------------

BASELINE_ARGV = ["simulate", "--model", "Llama-3-8B", "--gpu", "H100-SXM", "--workload", "sharegpt",
                 "--request-rate", "20", "--num-requests", "300", "--shared-prefix-share", "0.3",
                 "--shared-prefix-len", "128"]  # fmt: skip


@pytest.mark.parametrize("extra", [[], ["--tensor-parallel-size", "1", "--data-parallel-size", "1", "--interconnect", "PCIe4"]])
def test_tp1_results_are_unchanged(capsys, extra):
    # Pinned from the simulator before tensor/data parallelism existed.
    code, out, _ = run(capsys, *BASELINE_ARGV, *extra, "--json")
    assert code == 0
    r = json.loads(out)["results"]
    assert (r["duration_s"], r["output_tok_s"], r["num_steps"], r["kv_capacity_tokens"]) == (26.47, 3620.431, 3619, 456624)
    assert (r["ttft_ms_p99"], r["itl_ms_median"], r["prefix_hit_rate"]) == (30.149, 7.578, 0.1817)


def test_simulate_with_tp_and_dp_on_the_command_line(capsys, tmp_path):
    result_file = tmp_path / "sim.jsonl"
    code, table, _ = run(capsys, "simulate", "--model", "Llama-3-70B", "--gpu", "H200", "--num-requests", "40",
                         "--request-rate", "10", "--tensor-parallel-size", "4", "--data-parallel-size", "2",
                         "--result-file", str(result_file))  # fmt: skip
    assert code == 0
    record = json.loads(result_file.read_text())
    assert record["parallel"] == {
        "tensor_parallel_size": 4, "data_parallel_size": 2, "num_gpus": 8, "interconnect": "NVLink4",
        "interconnect_unidirectional_gbs": 450.0, "allreduce_efficiency": 0.8, "allreduce_latency_us": 10.0,
        "routing": "round-robin",
    }  # fmt: skip
    assert record["engine"]["tensor_parallel_size"] == 4 and record["engine"]["data_parallel_size"] == 2
    assert record["cost_model"]["name"] == "roofline: Llama-3-70B on H200, TP=4 over NVLink4"
    assert record["results"]["completed"] == 40
    # Two replicas' caches together.
    assert record["results"]["kv_capacity_tokens"] == 2 * (record["kv_cache"]["num_gpu_blocks"] - 1) * 16
    assert "8 GPUs: 2 replicas x TP=4 over NVLink4" in table and "2 replicas x " in table


def test_flags_parse_into_the_target():
    args = build_parser().parse_args([
        "simulate", "--model", "Llama-3-70B", "--tensor-parallel-size", "8", "--data-parallel-size", "2",
        "--interconnect", "PCIe5", "--allreduce-efficiency", "0.7", "--allreduce-latency-us", "20",
    ])  # fmt: skip
    assert (args.tensor_parallel_size, args.data_parallel_size, args.interconnect) == (8, 2, "PCIe5")
    link = target_from_args(args).tensor_parallel
    assert link is not None and link.tensor_parallel_size == 8
    assert link.interconnect.name == "PCIe5" and link.bandwidth == pytest.approx(64e9 * 0.7)
    assert link.latency_s == pytest.approx(20e-6)
    defaults = build_parser().parse_args(["tune"])
    assert (defaults.tensor_parallel_size, defaults.data_parallel_size, defaults.num_gpus) == (1, 1, None)
    assert defaults.interconnect is None and defaults.allreduce_latency_us is None
    assert build_parser().parse_args(["tune", "--num-gpus", "8"]).num_gpus == 8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--interconnect", "NVLink9"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--num-gpus", "8"])  # a tune flag


@pytest.mark.parametrize("argv,fragment", [
    (["simulate", "--model", "Qwen2.5-7B", "--tensor-parallel-size", "8"], "num_attention_heads=28 does not split over TP=8"),
    (["simulate", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
    (["simulate", "--data-parallel-size", "0"], "--data-parallel-size must be at least 1"),
    (["simulate", "--tensor-parallel-size", "2", "--allreduce-efficiency", "0"], "--allreduce-efficiency must be in (0, 1]"),
    (["tune", "--num-gpus", "8", "--tensor-parallel-size", "2"], "leave out --tensor-parallel-size"),
    (["tune", "--num-gpus", "0"], "--num-gpus must be at least 1"),
])  # fmt: skip
def test_bad_parallel_input_is_one_error_line(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("pagellm: error:")]
    assert len(errors) == 1 and fragment in errors[0], err


def test_tp_needs_the_roofline_model(tmp_path, capsys):
    from pagellm.sim.calibrated import CalibratedCostModel, FitQuality, StepCostFit

    path = tmp_path / "cal.json"
    fit = StepCostFit((1, 64), (0.01, 0.05), (1,), (0.0,), 0.0, 0.0, 0.0, FitQuality(1, 1.0, 0, 0, 0, 0))
    CalibratedCostModel(fit, "smol", get_model_preset("SmolLM2-135M").config, "bfloat16", 2).save(path)
    code, _, err = run(capsys, "simulate", "--calibration", str(path), "--tensor-parallel-size", "2")
    assert code == 1 and "a calibration measures one device" in err
    # Data parallelism of the measured engine is fine.
    code, out, _ = run(capsys, "simulate", "--calibration", str(path), "--data-parallel-size", "2",
                       "--num-requests", "10", "--prompt-len", "8", "16", "--output-len", "4", "8", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["parallel"]["data_parallel_size"] == 2


# --- Interconnect presets ------------------------------------------------------------


def test_interconnect_presets_and_their_sources():
    assert set(INTERCONNECT_PRESETS) == {"NVLink3", "NVLink4", "NVLink5", "PCIe4", "PCIe5"}
    expected = {"NVLink3": 300.0, "NVLink4": 450.0, "NVLink5": 900.0, "PCIe4": 32.0, "PCIe5": 64.0}
    for name, spec in INTERCONNECT_PRESETS.items():
        # The ring formula's bandwidth is per direction: half the bidirectional figure.
        assert spec.unidirectional_gbs == expected[name]
        assert len(spec.source) > 60 and "per direction" in spec.source
    assert "600 GB/s" in INTERCONNECT_PRESETS["NVLink3"].source
    assert "900 GB/s" in INTERCONNECT_PRESETS["NVLink4"].source
    assert "1.8 TB/s" in INTERCONNECT_PRESETS["NVLink5"].source
    assert get_interconnect_preset("nvlink5").name == "NVLink5"
    with pytest.raises(ConfigError, match="NVLink4"):
        get_interconnect_preset("infiniband")


def test_each_gpu_preset_has_its_link():
    links = {name: default_interconnect(get_gpu_preset(name)).name
             for name in ("A100-40GB", "A100-80GB", "H100-SXM", "H200", "L4", "A10G")}  # fmt: skip
    assert links == {"A100-40GB": "NVLink3", "A100-80GB": "NVLink3", "H100-SXM": "NVLink4",
                     "H200": "NVLink4", "L4": "PCIe4", "A10G": "PCIe4"}  # fmt: skip
    bare = GpuSpec("bare", 1.0, 1.0, 1.0, 1.0, "test")
    with pytest.raises(ConfigError, match="give --interconnect"):
        default_interconnect(bare)
