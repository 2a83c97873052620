"""`pagellm tune --num-gpus N`: the TP x DP layouts, their refusals, SLO attainment and
the best layout."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.cli import main
from pagellm.sim.model_presets import get_model_preset
from pagellm.sim.simulator import SimRequestResult
from pagellm.sim.tune import TuneGoal, command_line, slo_attainment
from pagellm.sim.tune_layouts import (
    Layout,
    best_layout_line,
    enumerate_layouts,
    layout_label,
)


def layouts_of(num_gpus: int, model: str) -> list[tuple[int, int, str | None]]:
    config = get_model_preset(model).config
    return [(l.tensor_parallel_size, l.data_parallel_size, l.error) for l in enumerate_layouts(num_gpus, config)]


def test_every_layout_of_n_gpus_widest_tp_first():
    assert layouts_of(8, "Llama-3-70B") == [(8, 1, None), (4, 2, None), (2, 4, None), (1, 8, None)]
    # Qwen2.5-7B has 28 query heads and 4 KV heads: TP=8 cannot split them.
    qwen = layouts_of(8, "Qwen2.5-7B")
    assert [(tp, dp) for tp, dp, _ in qwen] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert qwen[0][2] == "num_attention_heads=28 does not split over TP=8"
    assert [error for _, _, error in qwen[1:]] == [None, None, None]
    # SmolLM2 has 9 heads (3 KV): of 6 GPUs only TP=3 and TP=1 split.
    smol = layouts_of(6, "SmolLM2-135M")
    assert [(tp, dp, error is None) for tp, dp, error in smol] == [(6, 1, False), (3, 2, True), (2, 3, False), (1, 6, True)]
    assert Layout(4, 2).knobs == {"tensor_parallel_size": 4, "data_parallel_size": 2}
    assert [layout_label(8, 1), layout_label(4, 2), layout_label(1, 8)] == ["TP=8", "2 x TP=4", "8 x TP=1"]


def result(arrival: float, first: float | None, finish: float | None, outputs: int) -> SimRequestResult:
    return SimRequestResult(arrival, 10, outputs if finish else 0, outputs, first, finish)


def test_slo_attainment_per_request():
    goal = TuneGoal(max_p99_ttft_ms=500, max_p99_itl_ms=50)
    requests = [
        result(0.0, 0.4, 0.4 + 10 * 0.04, 11),  # TTFT 400 ms, TPOT 40 ms: meets both
        result(0.0, 0.6, 0.6 + 10 * 0.04, 11),  # TTFT 600 ms: misses
        result(1.0, 1.1, 1.1 + 10 * 0.06, 11),  # TPOT 60 ms: misses
        result(2.0, 2.2, 2.2, 1),  # one token: only TTFT counts, meets
        result(3.0, None, None, 5),  # refused: misses
    ]
    assert slo_attainment(requests, goal) == 0.4
    assert slo_attainment(requests, TuneGoal(max_p99_ttft_ms=500)) == 0.6
    assert slo_attainment(requests, TuneGoal()) is None  # no limits, nothing to attain


def test_command_line_carries_the_layout():
    engine = {"tensor_parallel_size": 4, "data_parallel_size": 2, "max_num_seqs": 256}
    assert command_line("Llama-3-70B", engine) == (
        "pagellm serve --model Llama-3-70B --data-parallel-size 2 --tensor-parallel-size 4 --max-num-seqs 256"
    )
    assert command_line("Llama-3-70B", {"tensor_parallel_size": 8}) == (
        "pagellm serve --model Llama-3-70B --tensor-parallel-size 8"
    )


def test_best_layout_line():
    record = {
        "num_gpus": 8,
        "recommended": {"knobs": {"tensor_parallel_size": 4, "data_parallel_size": 2}, "meets_goal": True},
        "points": [{"knobs": {"tensor_parallel_size": 1, "data_parallel_size": 8}, "results": None}],
    }
    assert best_layout_line(record) == "best layout for 8 GPUs: 2 x TP=4 (2 replicas of 4 GPUs); refused: 8 x TP=1"
    assert best_layout_line({"recommended": None}) is None


def tune_layouts(capsys, tmp_path, *extra: str) -> tuple[dict, list[str]]:
    """The record (from --result-file) and the table (stdout)."""
    result_file = tmp_path / "tune.jsonl"
    argv = ["tune", "--num-gpus", "8", "--model", "Llama-3-70B", "--gpu", "H100-SXM", "--num-requests", "60",
            "--request-rate", "20", "--max-p99-ttft-ms", "2000", "--max-p99-itl-ms", "50", "--jobs", "1",
            "--plot", "", "--result-file", str(result_file), *extra]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    (line,) = result_file.read_text().splitlines()
    return json.loads(line), out


def test_tune_compares_the_layouts_of_8_gpus(capsys, tmp_path):
    record, table = tune_layouts(capsys, tmp_path)
    assert record["num_gpus"] == 8
    assert record["grid"] == {"tensor_parallel_size": [8, 4, 2, 1], "data_parallel_size": [1, 2, 4, 8]}
    points = {(p["knobs"]["tensor_parallel_size"], p["knobs"]["data_parallel_size"]): p for p in record["points"]}
    assert set(points) == {(8, 1), (4, 2), (2, 4), (1, 8)}
    # 8 replicas of one GPU: 70B does not fit on an 80 GB GPU; refused, ranked last.
    refused = points[(1, 8)]
    assert refused["results"] is None and record["points"][-1] is refused
    assert "no memory left for the KV cache on H100-SXM" in refused["error"]
    assert "it fits with --tensor-parallel-size 2, 4, 8 (now 1)" in refused["error"]
    for layout in ((8, 1), (4, 2), (2, 4)):
        r = points[layout]["results"]
        assert r["completed"] == 60 and r["slo_attainment"] is not None
        assert points[layout]["engine"].get("tensor_parallel_size") == layout[0]
    # Wider TP: less of the model per GPU per step, so shorter inter-token gaps.
    itl = {layout: points[layout]["results"]["itl_ms_median"] for layout in ((8, 1), (4, 2), (2, 4))}
    assert itl[(8, 1)] < itl[(4, 2)] < itl[(2, 4)]
    best = record["points"][0]
    knobs = best["knobs"]
    assert record["recommended"]["knobs"] == knobs
    assert f"--tensor-parallel-size {knobs['tensor_parallel_size']}" in record["recommended"]["command"]
    assert any(line.startswith("best layout for 8 GPUs: ") and "refused: 8 x TP=1" in line for line in table)
    header = next(line for line in table if line.lstrip().startswith("#"))
    for label in ("TP", "DP", "out tok/s", "TTFT p99", "ITL p99", "SLO att."):
        assert label in header
    assert record["interconnect"]["interconnect"] == "NVLink4"


def test_a_layout_matches_simulate_with_the_same_flags(capsys, tmp_path):
    record, _ = tune_layouts(capsys, tmp_path)
    point = next(p for p in record["points"] if p["knobs"] == {"tensor_parallel_size": 4, "data_parallel_size": 2})
    assert main(["simulate", "--model", "Llama-3-70B", "--gpu", "H100-SXM", "--num-requests", "60", "--request-rate", "20",
                 "--tensor-parallel-size", "4", "--data-parallel-size", "2", "--json"]) == 0  # fmt: skip
    simulated = json.loads(capsys.readouterr().out)["results"]
    for key in ("output_tok_s", "ttft_ms_p99", "itl_ms_p99", "kv_capacity_tokens", "num_steps"):
        assert point["results"][key] == simulated[key], key


def test_layouts_cross_the_knobs_given(capsys, tmp_path):
    record, _ = tune_layouts(capsys, tmp_path, "--max-num-seqs", "64", "128", "--num-requests", "20")
    assert len(record["points"]) == 8  # 4 layouts x 2 values
    assert {p["knobs"]["max_num_seqs"] for p in record["points"]} == {64, 128}


def test_layouts_that_do_not_split_are_refused_without_simulating(capsys):
    assert main(["tune", "--num-gpus", "4", "--model", "SmolLM2-135M", "--gpu", "L4", "--num-requests", "20",
                 "--jobs", "1", "--plot", "", "--json"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    errors = {p["knobs"]["tensor_parallel_size"]: p["error"] for p in record["points"]}
    assert errors[4] == "num_attention_heads=9 does not split over TP=4"
    assert errors[2] == "num_attention_heads=9 does not split over TP=2"
    assert errors[1] is None
    assert record["recommended"]["knobs"] == {"tensor_parallel_size": 1, "data_parallel_size": 4}
    assert [l["error"] is None for l in record["layouts"]] == [False, False, True]


@pytest.mark.parametrize("extra", [[], ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]])
def test_tune_without_num_gpus_keeps_its_grid(capsys, extra):
    assert main(["tune", "--model", "Llama-3-8B", "--num-requests", "20", "--max-num-seqs", "8", "16",
                 "--max-num-batched-tokens", "512", "--jobs", "1", "--plot", "", "--json", *extra]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert record["grid"] == {"max_num_seqs": [8, 16], "max_num_batched_tokens": [512]}
    assert "num_gpus" not in record
    engine = record["points"][0]["engine"]
    if extra:
        assert engine["tensor_parallel_size"] == 2 and engine["data_parallel_size"] == 2
    else:
        assert "tensor_parallel_size" not in engine
