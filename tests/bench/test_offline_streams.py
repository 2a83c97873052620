"""benchmarks/serve_overhead.py: the offline side (the engine's token timeline as serve
records, summarized by the same code as a server's stream), the server trace's stages
(pagellm/bench/stream_trace.py), and one tiny run of the whole benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm import EngineArgs
from pagellm.bench.offline_streams import measure_offline
from pagellm.bench.serve_metrics import summarize
from pagellm.bench.stream_trace import summarize_trace
from pagellm.engine.llm_engine import LLMEngine

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-offline-streams"), "llama", seed=6)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(folder), max_model_len=128, num_gpu_blocks_override=64))
    yield engine
    engine.close()


def test_every_request_gets_one_timed_chunk_per_token(engine):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    run = measure_offline(engine, prompts, [6, 3, 1])
    assert [r.output_tokens for r in run.records] == [6, 3, 1]
    assert all(r.success and r.error is None for r in run.records)
    for record in run.records:
        times = record.chunk_times_s
        assert len(times) == record.output_tokens  # one token per decode step here
        assert times == sorted(times) and record.ttft_s == times[0] <= record.end_s
    assert run.num_steps == len(run.step_seconds) >= 6
    summary = summarize(run.records, run.duration_s)
    assert summary["completed"] == 3 and summary["output_len_mismatches"] == 0
    assert summary["total_output_tokens"] == 10
    assert summary["itl_ms_median"] is not None
    assert not engine.has_unfinished_requests()


def test_prompts_and_lengths_must_pair_up(engine):
    with pytest.raises(ValueError, match="2 prompts but 1 output lengths"):
        measure_offline(engine, [[1], [2]], [3])


def test_the_trace_times_each_stage_from_the_one_before():
    # Two steps of two streams each; the event loop delivers step 1 while step 2 runs.
    events = [
        ("step_start", 0.000), ("model_done", 0.006), ("processed", 0.0061), ("handed_off", 0.0062),
        ("step_start", 0.0063), ("delivered", 0.0070),
        ("taken", 0.0071), ("encoded", 0.0072), ("written", 0.0073),
        ("taken", 0.0074), ("encoded", 0.0075), ("written", 0.0076),
        ("model_done", 0.0120), ("processed", 0.0121), ("handed_off", 0.0122), ("delivered", 0.0125),
        ("taken", 0.0126), ("encoded", 0.0127), ("written", 0.0128),
    ]  # fmt: skip
    summary = summarize_trace(events)
    assert summary["num_steps"] == 2
    stages = summary["stage_ms_median"]
    assert stages["model_done"] == pytest.approx((6.0 + 5.7) / 2)
    assert stages["processed"] == pytest.approx(0.1)
    assert stages["delivered"] == pytest.approx((0.8 + 0.3) / 2)
    # Step 1 fanned out to two streams: its last chunk left 0.6 ms after the delivery.
    assert summary["fan_out_ms_median"]["last_written"] == pytest.approx((0.6 + 0.3) / 2)
    assert summary["between_steps_ms_median"] == pytest.approx(0.1)


def test_the_serve_overhead_benchmark_runs_both_sides(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path / "tiny", "llama", seed=7)
    script = BENCHMARKS / "serve_overhead.py"
    out = tmp_path / "overhead.jsonl"
    command = [sys.executable, str(script), "--streams", "1", "2", "--rounds", "1", "--prompt-len", "8",
               "--output-len", "5", "--out", str(out), "--model", str(folder), "--max-model-len", "64",
               "--num-gpu-blocks-override", "64"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["streams"] for row in rows] == [1, 2]
    for row in rows:
        for side in ("offline", "online"):
            assert row[side]["failed"] == 0 and row[side]["itl_ms_median"] > 0
        assert row["itl_ratio"] > 0 and row["output_tok_s_ratio"] > 0
        assert row["paired"]["itl_ratio"] > 0 and row["paired"]["ttft_added_ms"] is not None
    assert "| 2 |" in result.stdout and "2 streams: ITL ratio" in result.stdout
