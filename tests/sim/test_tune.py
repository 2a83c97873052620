"""`pagellm tune`: the grid, the ranking for each goal, the recommendation and the chart."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.cli import main
from pagellm.errors import ConfigError
from pagellm.sim.tune import TuneGoal, TunePoint, command_line, grid_points, rank, violations


def point(seqs: int, tok_s: float, ttft_p99: float, itl_p99: float = 10.0, completed: int = 10) -> TunePoint:
    summary = {"num_requests": 10, "completed": completed, "output_tok_s": tok_s,
               "ttft_ms_p99": ttft_p99, "itl_ms_p99": itl_p99, "ttft_ms_median": ttft_p99 / 2}  # fmt: skip
    return TunePoint({"max_num_seqs": seqs}, summary)


def seqs_of(points: list[TunePoint]) -> list[int]:
    return [p.knobs["max_num_seqs"] for p in points]


def test_grid_is_every_combination_in_order():
    assert grid_points({"a": (1, 2), "b": ("x", "y")}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"},
    ]  # fmt: skip


def test_throughput_goal_respects_the_latency_limits():
    goal = TuneGoal("throughput", max_p99_ttft_ms=500, max_p99_itl_ms=50)
    points = [
        point(1, 900.0, 200.0),
        point(2, 1500.0, 900.0),  # fastest, but misses the TTFT limit
        point(3, 1200.0, 300.0),
        point(4, 1100.0, 100.0, itl_p99=80.0),  # misses the ITL limit
        point(5, 1300.0, 100.0, completed=9),  # refuses a request
        TunePoint({"max_num_seqs": 6}, None, error="KV cache too small"),
    ]
    # Meeting the limits first (by throughput); then one miss each, by throughput; invalid last.
    assert seqs_of(rank(points, goal)) == [3, 1, 2, 5, 4, 6]
    assert violations(points[1], goal) == ["p99 TTFT 900.0 ms > 500"]
    assert violations(points[4], goal) == ["1 requests refused"]


def test_throughput_ties_go_to_the_lower_latency():
    goal = TuneGoal("throughput")
    points = [point(1, 1000.0, 400.0), point(2, 995.0, 100.0), point(3, 900.0, 50.0)]
    assert seqs_of(rank(points, goal)) == [2, 1, 3]


def test_latency_goal_minimizes_the_chosen_statistic():
    points = [point(1, 1000.0, 400.0), point(2, 500.0, 100.0), point(3, 900.0, 250.0)]
    assert seqs_of(rank(points, TuneGoal("latency"))) == [2, 3, 1]
    assert seqs_of(rank(points, TuneGoal("latency", latency_metric="ttft_median"))) == [2, 3, 1]


def test_bad_goals():
    with pytest.raises(ConfigError, match="--goal"):
        TuneGoal("cheapest")
    with pytest.raises(ConfigError, match="--latency-metric"):
        TuneGoal("latency", latency_metric="ttft_p42")
    with pytest.raises(ConfigError, match="max-p99-ttft-ms"):
        TuneGoal(max_p99_ttft_ms=0)


def test_command_line():
    engine = {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "max_model_len": 8192, "block_size": 16,
              "gpu_memory_utilization": 0.95, "enable_chunked_prefill": True, "enable_prefix_caching": False}  # fmt: skip
    assert command_line("Llama-3-8B", engine) == (
        "pagellm serve --model Llama-3-8B --max-num-seqs 128 --max-num-batched-tokens 4096 "
        "--max-model-len 8192 --block-size 16 --gpu-memory-utilization 0.95 --no-enable-prefix-caching"
    )


def tune_argv(tmp_path, jobs: str, plot: str) -> list[str]:
    return ["tune", "--model", "SmolLM2-135M", "--gpu", "L4", "--num-requests", "40", "--request-rate", "30",
            "--prompt-len", "16", "400",
            "--max-num-seqs", "4", "32", "--max-num-batched-tokens", "256", "1024", "--max-model-len", "512", "8192",
            "--max-p99-ttft-ms", "400", "--plot", plot, "--result-file", str(tmp_path / "tune.jsonl"),
            "--jobs", jobs]  # fmt: skip


def test_tune_end_to_end(tmp_path, capsys):
    chart = tmp_path / "tune.png"
    assert main(tune_argv(tmp_path, "2", str(chart))) == 0  # two processes
    out = capsys.readouterr().out.splitlines()
    # The ranked table on stdout; the record in --result-file.
    assert out[0].startswith("SmolLM2-135M on L4") and not any(line.startswith("{") for line in out)
    (line,) = (tmp_path / "tune.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert set(record) == {"bench", "time", "cost_model", "target", "goal", "grid", "workload", "points",
                           "recommended", "wall_s"}  # fmt: skip
    assert len(record["points"]) == 8 and [p["rank"] for p in record["points"]] == list(range(1, 9))
    assert record["grid"] == {"max_num_seqs": [4, 32], "max_num_batched_tokens": [256, 1024], "max_model_len": [512, 8192]}
    best = record["points"][0]
    assert record["recommended"]["knobs"] == best["knobs"]
    assert record["recommended"]["command"].startswith("pagellm serve --model SmolLM2-135M --max-num-seqs ")
    assert any(line.startswith("recommended: pagellm serve") for line in out)
    # max_model_len 512 refuses the workload's longer requests.
    assert all(p["misses"] for p in record["points"] if p["knobs"]["max_model_len"] == 512)
    assert chart.exists() and chart.stat().st_size > 10_000
    # Same grid, same workload: the same ranking in one process; --json prints the record
    # (and only it) instead of the table, with the same keys.
    assert main([*tune_argv(tmp_path, "1", ""), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert set(again) == set(record)
    assert [p["knobs"] for p in again["points"]] == [p["knobs"] for p in record["points"]]
    assert [p["results"] for p in again["points"]] == [
        {**p["results"], "sim_wall_s": q["results"]["sim_wall_s"]} for p, q in zip(record["points"], again["points"])
    ]


def point_of(knobs: dict) -> object:  # module level: the spawned workers unpickle it
    return point(knobs["max_num_seqs"], 1.0, 1.0)


@pytest.mark.parametrize("jobs", [1, 2])
def test_run_grid_reports_each_point_done_and_keeps_the_grid_order(jobs):
    from pagellm.sim.tune import run_grid

    points = [{"max_num_seqs": n} for n in (8, 1, 4, 2)]
    done = []
    results = run_grid(points, point_of, jobs, lambda: done.append(1))
    assert seqs_of(results) == [8, 1, 4, 2] and len(done) == 4
