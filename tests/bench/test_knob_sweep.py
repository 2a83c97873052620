"""`pagellm bench knobs`: every setting serves the same requests on a real engine and
lands in the table, the JSONL file and the chart."""

from __future__ import annotations

import argparse
import json

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm.bench.knob_sweep import SETTINGS, run_bench_knobs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=6)


def test_sweep_runs_each_setting_on_the_same_workload(folder, tmp_path, capsys):
    args = argparse.Namespace(
        model=str(folder), dtype="float32", max_model_len=128, request_rate=50.0, burstiness=1.0,
        settings=["default", "interactive", "shortest-remaining"], out_dir=str(tmp_path),
        workload="mixed", num_requests=8, prompt_len=(4, 40), output_len=(2, 12), shared_prefix_len=8, turns=8, seed=1,
    )  # fmt: skip
    records = run_bench_knobs(args)
    assert [r["setting"] for r in records] == args.settings
    assert all(r["completed"] == r["num_requests"] == 8 for r in records)
    assert all(r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 for r in records)
    # The settings really reached the scheduler.
    assert records[1]["resolved"]["max_num_partial_prefills"] == 1
    assert records[1]["resolved"]["prefill_share"] == 0.25
    assert records[2]["resolved"]["scheduling_policy"] == "shortest-remaining"
    lines = (tmp_path / "knobs.jsonl").read_text().splitlines()
    assert [json.loads(line)["setting"] for line in lines] == args.settings
    assert (tmp_path / "knobs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| interactive |" in out and "chart:" in out


def test_every_named_setting_is_valid_engine_arguments():
    from pagellm.config.engine_args import EngineArgs

    for knobs in SETTINGS.values():
        EngineArgs(**knobs).with_profile()
