"""Simulated workloads: the benchmarks' lengths and arrivals, a shared-prefix share, traces."""

from __future__ import annotations

import json

import pytest

from pagellm.workload.arrivals import arrival_times
from pagellm.workload.synthetic import WorkloadSpec, make_workload
from pagellm.errors import ConfigError
from pagellm.sim.request_stream import (
    SimRequest,
    SyntheticWorkload,
    make_synthetic_requests,
    read_trace,
    write_trace,
)


def test_same_lengths_and_arrivals_as_the_benchmarks():
    spec = WorkloadSpec(kind="mixed", num_requests=40, seed=3)
    requests = make_synthetic_requests(SyntheticWorkload(spec, request_rate=4.0, burstiness=0.5))
    bench = make_workload(spec)
    assert [r.prompt_token_ids for r in requests] == [b.prompt_token_ids for b in bench]
    assert [r.output_len for r in requests] == [b.output_len for b in bench]
    assert [r.arrival_s for r in requests] == arrival_times(40, 4.0, 0.5, 3)


def test_deterministic_for_a_seed_and_different_across_seeds():
    def make(seed):
        return make_synthetic_requests(SyntheticWorkload(
            WorkloadSpec(kind="sharegpt", num_requests=30, seed=seed), request_rate=2.0,
            shared_prefix_share=0.5))  # fmt: skip

    assert make(1) == make(1)
    assert make(1) != make(2)


def test_duration_sets_the_number_of_requests():
    spec = WorkloadSpec(kind="fixed", prompt_len=(8, 8), output_len=(4, 4))
    requests = make_synthetic_requests(SyntheticWorkload(spec, request_rate=20.0, duration_s=50.0))
    assert all(r.arrival_s < 50.0 for r in requests)
    assert len(requests) == pytest.approx(1000, rel=0.15)  # Poisson: 1000 +- ~3%
    longer = make_synthetic_requests(SyntheticWorkload(spec, request_rate=20.0, duration_s=60.0))
    assert [r.arrival_s for r in longer[: len(requests)]] == [r.arrival_s for r in requests]


def test_a_share_of_prompts_gets_the_prefix():
    spec = WorkloadSpec(kind="mixed", num_requests=400, prompt_len=(5, 20), shared_prefix_len=32, seed=0)
    requests = make_synthetic_requests(SyntheticWorkload(spec, shared_prefix_share=0.25), max_model_len=100)
    prefix = next(r.prompt_token_ids[:32] for r in requests if len(r.prompt_token_ids) > 32)
    with_prefix = [r for r in requests if r.prompt_token_ids[:32] == prefix]
    assert len(with_prefix) == pytest.approx(100, abs=30)
    assert all(len(r.prompt_token_ids) + r.output_len <= 100 for r in requests)
    none = make_synthetic_requests(SyntheticWorkload(spec))
    assert all(len(r.prompt_token_ids) <= 20 for r in none)


@pytest.mark.parametrize("kwargs,message", [
    ({"shared_prefix_share": 1.5}, "shared-prefix-share"),
    ({"duration_s": 10.0}, "finite --request-rate"),
    ({"duration_s": -1.0, "request_rate": 1.0}, "positive number"),
])
def test_bad_synthetic_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SyntheticWorkload(WorkloadSpec(), **kwargs)


def test_prefix_share_on_the_shared_prefix_workload_is_refused():
    with pytest.raises(ConfigError, match="already gives it"):
        make_synthetic_requests(SyntheticWorkload(WorkloadSpec(kind="shared-prefix"), shared_prefix_share=0.5))


def test_trace_round_trip_with_distinct_prompts(tmp_path):
    path = tmp_path / "trace.jsonl"
    requests = [SimRequest(1.5, [1, 2, 3], 7), SimRequest(0.25, [4] * 5, 2)]
    write_trace(requests, path)
    read = read_trace(path)
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in read] == [(0.25, 5, 2), (1.5, 3, 7)]
    assert not set(read[0].prompt_token_ids) & set(read[1].prompt_token_ids)


@pytest.mark.parametrize("line,message", [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"arrival_time": 0, "prompt_len": 3}', "missing 'output_len'"),
    ('{"arrival_time": "soon", "prompt_len": 3, "output_len": 1}', "must be a number"),
    ('{"arrival_time": -1, "prompt_len": 3, "output_len": 1}', ">= 0"),
    ('{"arrival_time": 0, "prompt_len": 0, "output_len": 1}', "prompt_len must be a positive integer"),
    ('{"arrival_time": 0, "prompt_len": 3, "output_len": 2.5}', "output_len must be a positive integer"),
])
def test_bad_trace_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"arrival_time": 0, "prompt_len": 1, "output_len": 1}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message) as error:
        read_trace(path)
    assert "t.jsonl:2" in str(error.value)


def test_empty_or_missing_trace(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no request"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")
