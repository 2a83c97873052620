"""`pagellm simulate` on the command line: a table on stdout (the record with --json, and
appended to --result-file); bad input gives one `pagellm: error:` line and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagellm.entrypoints.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# The record's top-level keys (what scripts read; the same as before the table became the default).
RECORD_KEYS = {"bench", "time", "cost_model", "target", "engine", "kv_cache", "parallel", "workload", "results"}


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_simulate_prints_a_table_and_writes_the_record(tmp_path, capsys):
    results = tmp_path / "sim.jsonl"
    code, out, _ = run(capsys, "simulate", "--model", "Qwen2.5-7B", "--gpu", "A100-80GB", "--workload", "sharegpt",
                       "--request-rate", "5", "--num-requests", "200", "--shared-prefix-share", "0.5",
                       "--shared-prefix-len", "256", "--result-file", str(results))  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    # People get the table only: no line of stdout is the JSON record.
    assert lines[0].startswith("cost model") and not any(line.lstrip().startswith("{") for line in lines)
    (line,) = results.read_text().splitlines()
    record = json.loads(line)
    assert set(record) == RECORD_KEYS
    r = record["results"]
    assert r["completed"] == 200 and r["rejected"] == 0
    assert r["prefix_hit_rate"] > 0.1  # half the prompts share 256 tokens
    assert record["cost_model"]["name"] == "roofline: Qwen2.5-7B on A100-80GB"
    assert record["engine"]["gpu_memory_utilization"] == 0.9
    for key in ("ttft_ms_p99", "itl_ms_median", "tpot_ms_p90", "e2el_ms_mean", "kv_usage_mean",
                "num_preemptions", "num_allocation_failures", "prefill_decode_ratio"):  # fmt: skip
        assert r[key] is not None, key
    waste = r["kv_waste"]
    assert waste["contiguous_waste_frac"] > waste["paged_waste_frac"]
    assert waste["contiguous_max_concurrency"] == r["kv_capacity_tokens"] // record["engine"]["max_model_len"]
    for label in ("output tok/s", "KV usage", "preemptions", "TTFT", "ITL", "max_model_len slabs"):
        assert label in out
    assert f"{r['completed']} completed" in out


def test_json_prints_the_record_instead_of_the_table(tmp_path, capsys):
    results = tmp_path / "out" / "sim.jsonl"
    argv = ["simulate", "--model", "SmolLM2-135M", "--gpu", "L4", "--num-requests", "3", "--result-file", str(results)]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    record = json.loads(out)  # stdout is one JSON document
    assert set(record) == RECORD_KEYS and record["results"]["completed"] == 3
    assert "cost model" not in out
    # --result-file appends: a second run adds a second line.
    code, out, _ = run(capsys, *argv)
    assert code == 0 and not is_json(out)
    first, second = (json.loads(line) for line in results.read_text().splitlines())
    assert first == record and set(second) == RECORD_KEYS


def test_a_trace_is_served_as_given(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": i * 0.5, "prompt_len": 100, "output_len": 20}) + "\n" for i in range(10)))
    code, out, _ = run(capsys, "simulate", "--trace", str(trace), "--model", "SmolLM2-135M", "--gpu", "L4", "--json")
    assert code == 0
    record = json.loads(out)
    assert record["workload"]["kind"] == "trace"
    assert record["results"]["total_output_tokens"] == 200 and record["results"]["total_input_tokens"] == 1000


@pytest.mark.parametrize("argv,fragment", [
    (["simulate", "--gpu", "B300"], "unknown GPU 'B300'"),
    (["simulate", "--model", "/no/such/model"], "neither a preset"),
    (["simulate", "--calibration", "/no/such.json"], "cannot read the calibration file"),
    (["simulate", "--trace", "/no/such.jsonl"], "cannot read the trace"),
    (["simulate", "--max-model-len", "100000"], "exceeds what Llama-3-8B supports (8192)"),
    (["simulate", "--model", "Llama-3-70B", "--gpu", "L4"], "no memory left for the KV cache on L4"),
    (["simulate", "--num-gpu-blocks-override", "10"], "too few for one request of max_model_len=8192"),
    (["simulate", "--request-rate", "0"], "--request-rate must be > 0"),
    (["simulate", "--prompt-len", "50", "10"], "--prompt-len needs 1 <= LO <= HI"),
    (["simulate", "--duration", "60"], "--duration needs a finite --request-rate"),
    (["simulate", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["simulate", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["simulate", "--compute-efficiency", "2"], "compute_efficiency must be in (0, 1]"),
    (["tune", "--goal", "latency", "--latency-metric", "ttft_p99", "--jobs", "0"], "--jobs must be at least 1"),
])  # fmt: skip
def test_bad_input_is_one_error_line(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("pagellm: error:")]
    assert len(errors) == 1 and fragment in errors[0], err
    assert "Traceback" not in err


def test_tune_refuses_memory_utilization_on_a_cpu_calibration(tmp_path, capsys):
    from pagellm.sim.calibrated import CalibratedCostModel, FitQuality, StepCostFit
    from pagellm.sim.model_presets import get_model_preset

    path = tmp_path / "cal.json"
    fit = StepCostFit((1, 64), (0.01, 0.05), (1,), (0.0,), 0.0, 0.0, 0.0, FitQuality(1, 1.0, 0, 0, 0, 0))
    CalibratedCostModel(fit, "smol", get_model_preset("SmolLM2-135M").config, "bfloat16", 2).save(path)
    code, _, err = run(capsys, "tune", "--calibration", str(path), "--gpu-memory-utilization", "0.8", "0.9")
    assert code == 1 and "has no effect with --calibration" in err


def test_the_installed_command_reports_errors_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "simulate", "--gpu", "nope"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("pagellm: error: unknown GPU")
    assert "Traceback" not in result.stderr


def test_a_multi_turn_workload_with_a_disk_tier(tmp_path, capsys):
    """Conversations come back after others evicted them from a small KV cache: with a
    simulated disk tier their history is loaded, so returning turns start sooner."""
    argv = ["simulate", "--model", "Llama-3-8B", "--gpu", "L4", "--workload", "multi-turn",
            "--num-requests", "96", "--turns", "6", "--prompt-len", "300", "300", "--output-len", "40", "40",
            "--request-rate", "8", "--kv-cache-memory-bytes", str(2 * 1024**3), "--json"]  # fmt: skip
    code, out, _ = run(capsys, *argv)
    assert code == 0
    without = json.loads(out)
    code, out, _ = run(capsys, *argv, "--kv-offload-bytes", str(64 * 1024**3), "--kv-offload-read-gbps", "4")
    assert code == 0
    tiered = json.loads(out)
    assert without["workload"]["kind"] == "multi-turn" and without["results"]["completed"] == 96
    assert without["results"]["tier_hit_blocks"] == 0 and "kv_offload_bytes" not in without["engine"]
    r = tiered["results"]
    assert tiered["engine"]["kv_offload_bytes"] == 64 * 1024**3 and r["completed"] == 96
    assert r["tier_hit_blocks"] > 0 and r["tier_bytes_read"] > 0 and 0 < r["tier_bytes"] <= 64 * 1024**3
    assert r["num_prefill_tokens"] < without["results"]["num_prefill_tokens"]
    assert r["ttft_ms_median"] < without["results"]["ttft_ms_median"]


def test_tune_sweeps_the_disk_tier_size(tmp_path, capsys):
    """tune says how much tier a multi-turn workload needs: each swept size is a tier of
    that size (none at 0), and a winning tier is in the recommended command."""
    code, out, _ = run(capsys, "tune", "--model", "Llama-3-8B", "--gpu", "L4", "--workload", "multi-turn",
                       "--num-requests", "96", "--turns", "6", "--prompt-len", "300", "300", "--output-len", "40", "40",
                       "--request-rate", "8", "--kv-cache-memory-bytes", str(2 * 1024**3), "--max-num-seqs", "64",
                       "--max-num-batched-tokens", "2048", "--kv-offload-bytes", "0", str(64 * 1024**3), "--goal", "latency",
                       "--latency-metric", "ttft_median", "--plot", "", "--jobs", "1", "--json")  # fmt: skip
    assert code == 0
    record = json.loads(out)
    points = {p["knobs"]["kv_offload_bytes"]: p for p in record["points"]}
    assert set(points) == {0, 64 * 1024**3}
    assert points[0]["results"]["tier_hit_blocks"] == 0 and points[64 * 1024**3]["results"]["tier_hit_blocks"] > 0
    assert points[64 * 1024**3]["results"]["ttft_ms_median"] < points[0]["results"]["ttft_ms_median"]
    assert record["points"][0]["knobs"]["kv_offload_bytes"] == 64 * 1024**3
    assert record["recommended"]["command"].endswith(f"--kv-offload-path DIR --kv-offload-bytes {64 * 1024**3}")
