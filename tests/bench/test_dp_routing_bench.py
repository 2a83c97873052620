"""benchmarks/dp_routing.py: its pure helpers (workloads, best hit rates, /metrics deltas,
the table), without a server."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "dp_routing.py"


@pytest.fixture(scope="module")
def dp():
    spec = importlib.util.spec_from_file_location("dp_routing", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dp_routing"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["dp_routing"]


def test_grouped_workload_shares_a_prefix_per_group_and_is_shuffled(dp):
    requests = dp.grouped_prefix_requests(3, 4, (40, 50), (5, 9), (2, 3), seed=1)
    assert len(requests) == 12
    by_group = {}
    for r in requests:
        by_group.setdefault(r.group, []).append(r)
        assert 40 <= r.prefix_len <= 50 and 5 <= len(r.prompt_token_ids) - r.prefix_len <= 9
        assert 2 <= r.output_len <= 3
    assert sorted(by_group) == [0, 1, 2] and all(len(rs) == 4 for rs in by_group.values())
    for rs in by_group.values():
        prefixes = {tuple(r.prompt_token_ids[: r.prefix_len]) for r in rs}
        suffixes = {tuple(r.prompt_token_ids[r.prefix_len :]) for r in rs}
        assert len(prefixes) == 1 and len(suffixes) == 4
    assert [r.group for r in requests] != sorted(r.group for r in requests)  # shuffled
    assert requests == dp.grouped_prefix_requests(3, 4, (40, 50), (5, 9), (2, 3), seed=1)  # reproducible


def test_best_hit_rate_counts_full_prefix_blocks_once_per_cache(dp):
    # One group: 4 requests, prefix 40 tokens (2 full blocks of 16), prompts of 50 tokens.
    requests = [dp.Request(list(range(50)), 1, group=0, prefix_len=40) for _ in range(4)]
    assert dp.best_hit_rate(requests, 1) == pytest.approx(3 * 32 / 200)
    assert dp.best_hit_rate(requests, 2) == pytest.approx(2 * 32 / 200)
    assert dp.best_hit_rate(requests[:1], 2) == 0.0
    assert dp.best_hit_rate([dp.Request([1, 2], 1)], 1) == 0.0  # no groups (mixed)


def test_mixed_requests_are_bench_serves_mixed_workload(dp):
    from pagellm.workload.synthetic import WorkloadSpec, make_workload

    ours = dp.mixed_requests(5, (16, 32), (8, 9), seed=3)
    theirs = make_workload(WorkloadSpec(kind="mixed", num_requests=5, prompt_len=(16, 32), output_len=(8, 9), seed=3))
    assert [(r.prompt_token_ids, r.output_len) for r in ours] == [(r.prompt_token_ids, r.output_len) for r in theirs]


ROUTER_BEFORE = """\
# TYPE pagellm:router_requests counter
pagellm:router_requests_total{reason="load",replica="0"} 2.0
pagellm:router_requests_total{reason="load",replica="1"} 2.0
# TYPE pagellm:prefix_cache_hits counter
pagellm:prefix_cache_hits_total{model_name="m",replica="0"} 10.0
pagellm:prefix_cache_hits_total{model_name="m",replica="1"} 0.0
# TYPE pagellm:prefix_cache_queries counter
pagellm:prefix_cache_queries_total{model_name="m",replica="0"} 100.0
pagellm:prefix_cache_queries_total{model_name="m",replica="1"} 100.0
# TYPE pagellm:request_success counter
pagellm:request_success_total{finished_reason="length",model_name="m",replica="0"} 2.0
pagellm:request_success_total{finished_reason="length",model_name="m",replica="1"} 2.0
"""
ROUTER_AFTER = """\
# TYPE pagellm:router_requests counter
pagellm:router_requests_total{reason="load",replica="0"} 3.0
pagellm:router_requests_total{reason="affinity",replica="0"} 4.0
pagellm:router_requests_total{reason="load",replica="1"} 3.0
# TYPE pagellm:prefix_cache_hits counter
pagellm:prefix_cache_hits_total{model_name="m",replica="0"} 70.0
pagellm:prefix_cache_hits_total{model_name="m",replica="1"} 20.0
# TYPE pagellm:prefix_cache_queries counter
pagellm:prefix_cache_queries_total{model_name="m",replica="0"} 200.0
pagellm:prefix_cache_queries_total{model_name="m",replica="1"} 200.0
# TYPE pagellm:request_success counter
pagellm:request_success_total{finished_reason="length",model_name="m",replica="0"} 7.0
pagellm:request_success_total{finished_reason="stop",model_name="m",replica="0"} 1.0
pagellm:request_success_total{finished_reason="length",model_name="m",replica="1"} 3.0
"""


def test_counter_deltas_sum_over_replicas_and_keep_the_router_decisions(dp):
    deltas = dp.counter_deltas(dp.parse_samples(ROUTER_BEFORE), dp.parse_samples(ROUTER_AFTER))
    assert deltas["total"]["prefix_hits"] == 80 and deltas["total"]["prefix_queries"] == 200
    assert deltas["prefix_hit_rate"] == pytest.approx(0.4)
    assert deltas["by_replica"]["requests_finished"] == {"0": 6.0, "1": 1.0}
    assert deltas["router_decisions"] == {"0/affinity": 4.0, "0/load": 1.0, "1/load": 1.0}
    assert deltas["total"]["prefill_tokens"] == 0  # absent metrics count as no growth


def test_counter_deltas_of_one_engine_have_no_replicas(dp):
    before = 'pagellm:prefix_cache_queries_total{model_name="m"} 5.0\n'
    after = 'pagellm:prefix_cache_queries_total{model_name="m"} 105.0\npagellm:prefix_cache_hits_total{model_name="m"} 25.0\n'
    deltas = dp.counter_deltas(dp.parse_samples(before), dp.parse_samples(after))
    assert deltas["prefix_hit_rate"] == pytest.approx(0.25)
    assert deltas["by_replica"] == {} and deltas["router_decisions"] == {}


def test_tables_report_ratios_and_failed_configs(dp):
    requests = {"mixed": [dp.Request([1] * 20, 4)], "grouped prefix": [dp.Request(list(range(40)), 2, 0, 32)] * 3}

    def workload(tok_s: float, hits: float | None, failed: int = 0) -> dict:
        return {"completed": 1, "num_requests": 1 + failed, "failed": failed, "errors": {"boom": failed} if failed else {}, "duration_s": 2.0, "requests_per_s": 0.5, "output_tok_s": tok_s,
                "ttft_ms_mean": 10.0, "ttft_ms_median": 9.0, "ttft_ms_p99": 20.0, "prefix_hit_rate": hits,
                "total": {"prefill_tokens": 20.0}, "by_replica": {}, "router_decisions": {}, "achieved_gflop_s": 1.0}  # fmt: skip

    records = [
        {"config": "one engine", "workloads": {"mixed": workload(100.0, 0.0), "grouped prefix": workload(50.0, 0.5)}},
        {"config": "DP=2 affinity", "workloads": {"mixed": workload(80.0, 0.0), "grouped prefix": workload(60.0, 0.4, failed=1)}},
        {"config": "DP=2 load", "error": "the server did not start"},
    ]
    lines, ratios = dp.render_tables(records, requests)
    assert ratios["mixed"]["output_tok_s_dp_affinity_over_one"] == 0.8
    assert ratios["mixed"]["hit_rate_dp_affinity_over_one"] is None  # 0 / 0
    assert ratios["grouped prefix"]["output_tok_s_dp_affinity_over_dp_load"] is None
    assert ratios["grouped prefix"]["best_hit_rate_one_cache"] == pytest.approx(2 * 32 / 120, abs=1e-4)
    text = "\n".join(lines)
    assert "| DP=2 load | failed: the server did not start |" in text
    assert "| DP=2 affinity | 1/2 | 2.0 | 0.50 | 60.0 | 10 / 9 / 20 | 40.0% | 20 |" in text
    notes = dp.notes(records, ratios, 2, {"one_engine": 2, "per_replica": 1})
    assert any("0.80x the one engine" in line for line in notes)
    assert any("DP=2 affinity, grouped prefix: 1 of 2 requests failed" in line for line in notes)
