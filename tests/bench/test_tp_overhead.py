"""benchmarks/tp_overhead.py (pagellm/bench/tp_overhead*.py): its pure helpers (bus bandwidth,
the alternation plan, the timers, the collectives plan, the comparison and the tables), and
one tiny end-to-end run (TP=1 and TP=2 engines, the driver's breakdown, the collectives alone)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from pagellm.bench import tp_overhead, tp_overhead_collectives, tp_overhead_report, tp_overhead_steps


def test_bus_bandwidth():
    # Two ranks: a ring all-reduce moves the whole buffer once per rank; four: 1.5 times.
    assert tp_overhead_collectives.all_reduce_bus_gbps(10**9, 1.0, 2) == pytest.approx(1.0)
    assert tp_overhead_collectives.all_reduce_bus_gbps(10**9, 0.5, 4) == pytest.approx(3.0)
    assert tp_overhead_collectives.all_gather_bus_gbps(2 * 10**9, 1.0, 2) == pytest.approx(1.0)


def test_summarize_ms():
    assert tp_overhead_steps.summarize_ms([0.001, 0.003, 0.002]) == {"mean": 2.0, "median": 2.0, "min": 1.0, "max": 3.0}


def test_interleaved_blocks_alternate_and_rotate():
    plan = tp_overhead_steps.interleaved_blocks(10, 4, [1, 2])
    assert plan == [(1, 4), (2, 4), (2, 4), (1, 4), (1, 2), (2, 2)]
    for name in (1, 2):
        assert sum(n for tp, n in plan if tp == name) == 10


def test_is_pure_decode():
    assert tp_overhead_steps.is_pure_decode({"a": 1, "b": 1}, 2)
    assert not tp_overhead_steps.is_pure_decode({"a": 1, "b": 5}, 2)  # a prefill chunk
    assert not tp_overhead_steps.is_pure_decode({"a": 1}, 2)


def test_call_timers():
    timer = tp_overhead_steps.CallTimer(lambda t: t * 2)
    timer(torch.ones(3, 4))
    timer(torch.ones(3, 4))
    assert timer.calls == 2 and timer.seconds > 0
    assert timer.tensor_sizes == {(48, "float32", (3, 4)): 2}
    message = ("step", {"ids": [1, 2, 3]})
    sent = tp_overhead_steps.MessageTimer(lambda m: m)
    assert sent(message) == message
    assert sent.message_bytes == [len(pickle.dumps(message))] and sent.calls == 1


def test_collectives_plan():
    reduce_shapes = [([1, 512], "float32"), ([1, 512], "float32"), ([1 << 20], "float32")]
    plan = tp_overhead_collectives.collectives_plan(reduce_shapes, [([32, 100], "bfloat16")], [500, 500], 100)
    assert [(p["op"], p["bytes"], p["iters"]) for p in plan] == [
        ("all_reduce", 2048, 100),
        ("all_reduce", 4 << 20, 10),  # big buffers: a tenth of the calls
        ("all_gather", 6400, 100),
        ("broadcast_object", 500, 100),
    ]


def fake_rows():
    def tp2(batch_size, step_ms):
        tensors = [{"bytes": 2048 * batch_size, "dtype": "float32", "shape": [batch_size, 512], "calls": 61}]
        return {
            "tp": 2, "batch_size": batch_size, "threads_per_rank": 1, "decode_path": "torch", "non_decode_steps": 0,
            "step_ms": {"mean": step_ms, "median": step_ms, "min": step_ms, "max": step_ms}, "tokens_per_s": 1.0,
            "execute_model_ms_mean": step_ms, "engine_ms_mean": 0.1, "communication_ms_mean": 10.0,
            "communication_share": 0.5, "driver_compute_ms_mean": 9.0,
            "broadcast": {"ms_per_step_mean": 0.2, "calls_per_step": 1.0, "us_per_call": 200.0, "tensors": [],
                          "message_bytes": {"median": 488, "min": 487, "max": 488}},
            "all_reduce": {"ms_per_step_mean": 9.15, "calls_per_step": 61.0, "us_per_call": 150.0, "tensors": tensors},
            "gather_vocab": {"ms_per_step_mean": 0.5, "calls_per_step": 1.0, "us_per_call": 500.0, "tensors": []},
        }  # fmt: skip

    tp1 = {
        "tp": 1, "batch_size": 1, "threads_per_rank": 2, "decode_path": "torch", "non_decode_steps": 0,
        "step_ms": {"mean": 10.0, "median": 10.0, "min": 10.0, "max": 10.0}, "tokens_per_s": 100.0,
        "execute_model_ms_mean": 9.9, "engine_ms_mean": 0.1,
    }  # fmt: skip
    return [tp1, tp2(1, 20.0)]


def test_comparison_and_tables():
    collectives = [{"op": "all_reduce", "shape": [1, 512], "dtype": "float32", "bytes": 2048, "iters": 10,
                    "us_median": 50.0, "us_mean": 60.0, "us_min": 40.0, "bus_gb_s": 0.04}]  # fmt: skip
    comparison = tp_overhead_report.comparison_rows(fake_rows(), collectives)
    assert len(comparison) == 1
    c = comparison[0]
    assert c["tp2_over_tp1"] == 2.0 and c["tp2_minus_tp1_ms"] == 10.0
    assert c["all_reduce_us_per_call_alone"] == 50.0
    assert c["all_reduce_wait_ms_per_step_estimate"] == pytest.approx((150 - 50) * 61 / 1000)
    record = {
        "config": {"threads": 2, "cpu_count": 2, "load_average_before": [3.0, 1.0, 1.0], "load_format": "dummy"},
        "results": {"steps": fake_rows(), "comparison": comparison, "collectives": collectives},
    }  # fmt: skip
    record["notes"] = tp_overhead_report.notes(record)
    assert any("busy" in note for note in record["notes"])
    tables = tp_overhead_report.format_tables(record)
    assert "| 2 | 1 | 1 | torch | 20.00 |" in tables
    assert "[1, 512] float32 (2048 B)" in tables and "Notes:" in tables


def test_quick_presets():
    args = tp_overhead.parse_args(["--quick", "--steps", "3"])
    assert args.steps == 3 and args.warmup == tp_overhead.QUICK["warmup"] and args.load_format == "dummy"
    assert tp_overhead.parse_args(["--model", "x"]).load_format == "auto"


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "tp.json"
    tp_overhead.main([
        "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
        "--vocab", "300", "--batch-sizes", "1", "3", "--steps", "2", "--warmup", "1", "--block-steps", "1",
        "--prompt-len", "4", "--micro-iters", "3", "--out", str(out),
    ])  # fmt: skip
    record = json.loads(out.read_text())
    rows = record["results"]["steps"]
    assert [(r["tp"], r["batch_size"]) for r in rows] == [(1, 1), (2, 1), (1, 3), (2, 3)]
    assert all(r["steps"] == 2 and r["non_decode_steps"] == 0 for r in rows)
    tp2 = [r for r in rows if r["tp"] == 2]
    # 2 layers: two row-parallel all-reduces each plus the embedding's; one logits gather.
    assert all(r["all_reduce"]["calls_per_step"] == 5 and r["gather_vocab"]["calls_per_step"] == 1 for r in tp2)
    assert all(r["broadcast"]["message_bytes"]["min"] > 0 for r in tp2)
    assert [t["shape"] for t in tp2[1]["all_reduce"]["tensors"]] == [[3, 64]]
    ops = [c["op"] for c in record["results"]["collectives"]]
    assert ops.count("all_reduce") == 3 and ops.count("all_gather") == 2 and "broadcast_object" in ops
    assert out.with_suffix(".md").read_text().startswith("# tp_overhead")
