"""`pagellm bench throughput`: workloads, FLOP accounting and the backends on a tiny model."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm.bench.ceiling import matmul_flops_per_token, workload_flops
from pagellm.workload.synthetic import WorkloadSpec, make_workload
from pagellm.errors import PagellmError
from pagellm.model.loader import ModelSource, load_model_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=4)


def test_workloads_are_deterministic_and_exact():
    a = make_workload(WorkloadSpec(num_requests=20, seed=3))
    b = make_workload(WorkloadSpec(num_requests=20, seed=3))
    assert a == b and len(a) == 20
    assert all(16 <= len(r.prompt_token_ids) <= 256 and 16 <= r.output_len <= 256 for r in a)
    share = make_workload(WorkloadSpec(kind="shared-prefix", num_requests=3, shared_prefix_len=40, prompt_len=(5, 5)))
    assert share[0].prompt_token_ids[:40] == share[2].prompt_token_ids[:40]
    sharegpt = make_workload(WorkloadSpec(kind="sharegpt", num_requests=2000, seed=1))
    mean_prompt = sum(len(r.prompt_token_ids) for r in sharegpt) / 2000
    mean_output = sum(r.output_len for r in sharegpt) / 2000
    assert 130 < mean_prompt < 190 and 280 < mean_output < 400
    assert max(r.output_len for r in sharegpt) > 1000  # a long tail
    clipped = make_workload(WorkloadSpec(kind="fixed", num_requests=1, prompt_len=(300, 300), output_len=(300, 300)), max_model_len=256)
    assert len(clipped[0].prompt_token_ids) + clipped[0].output_len <= 256


def test_flop_accounting_matches_the_parameter_count(folder):
    config = load_model_config(ModelSource("hf", folder, "tiny"))
    layer_params = config.num_parameters() - config.vocab_size * config.hidden_size * 2 - config.hidden_size
    norms = config.num_hidden_layers * 2 * config.hidden_size
    assert matmul_flops_per_token(config) == 2 * (layer_params - norms)
    one = workload_flops(config, [1], [1])  # one token, one LM head
    assert one == pytest.approx(matmul_flops_per_token(config) + 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim + 2 * config.hidden_size * config.vocab_size)


def bench_args(folder, backend, **extra):
    args = argparse.Namespace(
        backend=backend, model=str(folder), dtype="float32", hf_batch_sizes=[2, 4], llamacpp_parallel=4,
        max_num_seqs=256, max_num_batched_tokens=None, max_model_len=256, result_file=None, repeats=1,
        workload="mixed", num_requests=6, prompt_len=(4, 20), output_len=(3, 9), shared_prefix_len=8, turns=8, seed=0,
        check_requests=4, check_tokens=16, json=False,
    )  # fmt: skip
    for key, value in extra.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("backend", ["pagellm", "hf"])
def test_backends_produce_exact_work_and_a_record(folder, backend, tmp_path, capsys):
    from pagellm.bench.throughput import run_bench_throughput

    result_file = tmp_path / "r.jsonl"
    record = run_bench_throughput(bench_args(folder, backend, result_file=str(result_file)))
    requests = make_workload(WorkloadSpec(num_requests=6, prompt_len=(4, 20), output_len=(3, 9), vocab_low=100, vocab_high=256), 256)
    useful = sum(r.output_len for r in requests)
    assert record["output_tokens"] == useful
    assert record["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in requests)
    assert record["output_tok_s"] > 0 and record["elapsed_s"] >= 0
    assert record["matmul_ceiling_gflop_s"] > 0
    # Achieved FLOP/s is the workload's matmul FLOPs over the elapsed time (speed itself
    # depends on the machine's load, so only the accounting is checked).
    config = load_model_config(ModelSource("hf", folder, "tiny"))
    flops = workload_flops(config, [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests])
    assert record["achieved_gflop_s"] == pytest.approx(flops / record["elapsed_s"] / 1e9, rel=0.01, abs=0.06)
    # achieved_gflop_s is rounded to 0.1 and the fraction to 0.001: equal up to those roundings
    # (on a slow or busy machine 0.05 GFLOP/s is a large share of the ceiling).
    ceiling = record["matmul_ceiling_gflop_s"]
    assert record["fraction_of_ceiling"] == pytest.approx(record["achieved_gflop_s"] / ceiling, abs=0.05 / ceiling + 1e-3)
    assert json.loads(result_file.read_text().splitlines()[0])["backend"] == backend
    if backend == "hf":
        assert [s["batch_size"] for s in record["sweep"]] == [2, 4]
        assert record["settings"]["batch_size"] in (2, 4)
    # What was timed is checked: float32 greedy on either backend is HF float32's output.
    agreement = record["agreement"]
    assert agreement["reference"] == "hf float32 greedy" and agreement["num_requests"] == 4
    assert agreement["compared_tokens"] == [min(16, r.output_len) for r in requests[:4]]
    assert agreement["matched_tokens"] == agreement["compared_tokens"] and agreement["fraction"] == 1.0
    assert isinstance(record["cpu"]["model"], str) and isinstance(record["cpu"]["isa_flags"], list)
    out = capsys.readouterr().out
    # The table only: its header first, no JSON on stdout without --json.
    assert not out.startswith("{") and "output tok/s" in out
    header = out.splitlines()[0]
    assert "CPU " + record["cpu"]["model"] in header
    assert re.search(r"^agreement +1\.00 \(16 leading tokens x 4 requests vs hf float32 greedy\)$", out, re.M)


def test_leading_agreement_counts_up_to_the_first_mismatch():
    from pagellm.bench.agreement import describe_agreement, leading_agreement

    result = leading_agreement([[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[1, 2, 9, 4], [5, 6], [0, 8, 9]], num_tokens=3)
    # Request 0 parts at its third token: the fourth, equal again, no longer counts.
    assert result["matched_tokens"] == [2, 2, 0] and result["compared_tokens"] == [3, 2, 3]
    assert result["fraction"] == round(4 / 8, 4)
    assert describe_agreement(result) == "0.50 (3 leading tokens x 3 requests vs hf float32 greedy)"
    assert describe_agreement(None) == "not checked"
    with pytest.raises(ValueError):
        leading_agreement([[1]], [[1], [2]], 4)


def test_a_fast_wrong_engine_shows_in_its_agreement(folder, tmp_path, monkeypatch, capsys):
    """A backend whose outputs are not the model's greedy tokens reports low agreement."""
    from pagellm.bench import throughput
    from pagellm.bench.backends import BackendResult

    def wrong_engine(requests, *args, **kwargs):
        ids = [[(7 * i + k) % 256 for k in range(r.output_len)] for i, r in enumerate(requests)]
        return BackendResult("pagellm", 1e-3, sum(map(len, ids)), 0, output_token_ids=ids)

    monkeypatch.setattr(throughput, "run_pagellm", wrong_engine)
    record = throughput.run_bench_throughput(bench_args(folder, "pagellm", result_file=str(tmp_path / "r.jsonl")))
    assert record["agreement"]["fraction"] < 0.5
    assert json.loads((tmp_path / "r.jsonl").read_text())["agreement"] == record["agreement"]
    out = capsys.readouterr().out
    assert re.search(rf"^agreement +{record['agreement']['fraction']:.2f} \(16 leading tokens", out, re.M)
    # --check-requests 0 switches the check (and the reference model) off.
    record = throughput.run_bench_throughput(bench_args(folder, "pagellm", check_requests=0))
    assert record["agreement"] is None
    assert re.search(r"^agreement +not checked$", capsys.readouterr().out, re.M)


def test_json_prints_the_record_instead_of_the_table(folder, tmp_path, monkeypatch, capsys):
    from pagellm.bench import throughput
    from pagellm.bench.backends import BackendResult
    from pagellm.entrypoints.cli import build_parser

    def engine(requests, *args, **kwargs):  # a stand-in: only the output is under test
        ids = [[1] * r.output_len for r in requests]
        return BackendResult("pagellm", 1e-3, sum(map(len, ids)), 0, output_token_ids=ids)

    monkeypatch.setattr(throughput, "run_pagellm", engine)
    result_file = tmp_path / "r.jsonl"
    record = throughput.run_bench_throughput(
        bench_args(folder, "pagellm", check_requests=0, json=True, result_file=str(result_file))
    )
    out = capsys.readouterr().out
    assert json.loads(out) == record == json.loads(result_file.read_text())
    assert "output tok/s" not in out  # no table
    assert set(record) == {
        "bench", "time", "machine", "cpu", "model", "backend", "dtype", "workload", "settings", "sweep",
        "elapsed_s", "output_tokens", "prompt_tokens", "requests_per_s", "output_tok_s", "total_tok_s",
        "achieved_gflop_s", "matmul_ceiling_gflop_s", "fraction_of_ceiling", "peak_rss_bytes", "agreement",
    }  # fmt: skip
    assert record["peak_rss_bytes"] > 0  # pagellm ran in this process: its peak so far
    # The flags: --json off and results appended to bench-results/ unless told otherwise.
    args = build_parser().parse_args(["bench", "throughput"])
    assert args.json is False and args.result_file == "bench-results/throughput.jsonl"
    assert build_parser().parse_args(["bench", "throughput", "--json", "--result-file", ""]).json is True


def test_repeats_report_the_median_run(folder, tmp_path, monkeypatch):
    from pagellm.bench import backends
    from pagellm.bench.throughput import run_bench_throughput

    assert backends.median_run([3.0, 1.0, 2.0]) == 2.0
    assert backends.median_run([4.0, 1.0, 2.0, 3.0]) == 2.0  # lower middle
    args = bench_args(folder, "pagellm", result_file=str(tmp_path / "r.jsonl"))
    args.repeats = 3
    record = run_bench_throughput(args)
    runs = record["settings"]["elapsed_runs_s"]
    assert len(runs) == 3 and record["elapsed_s"] == pytest.approx(sorted(runs)[1], abs=1e-3)
    args.repeats = 0
    with pytest.raises(PagellmError, match="--repeats"):
        run_bench_throughput(args)


def test_the_structured_workload_compares_equal_work(smollm2_path, tmp_path, capsys):
    """json-schema requests against the same requests unconstrained at the same lengths."""
    from pagellm.bench.throughput import run_bench_throughput

    args = bench_args(
        smollm2_path, "pagellm", structured_output="json-schema", num_requests=4, output_len=(48, 48),
        prompt_len=(8, 8), result_file=str(tmp_path / "r.jsonl"), dtype="bfloat16",
    )  # fmt: skip
    record = run_bench_throughput(args)
    assert record["bench"] == "throughput-structured" and record["num_requests"] == 4
    # Bounded schemas end by themselves within 48 tokens or are cut: every whole one validates.
    assert record["valid_outputs"] >= record["ended_by_schema"] and record["output_tokens"] > 0
    assert record["constrained_s"] > 0 and record["unconstrained_s"] > 0 and record["ratio"] > 0
    assert len(record["schema_compile_ms"]) == 4 and record["ttft_new_schema_ms"] > 0
    assert "constrained / unconstrained" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.jsonl").read_text())["bench"] == "throughput-structured"
