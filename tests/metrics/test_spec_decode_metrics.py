"""Speculative-decoding figures in the metrics: totals, snapshot, stats line (no model)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.core.scheduler_stats import SchedulerStats
from pagellm.metrics.engine_metrics import EngineMetrics
from pagellm.metrics.spec_decode_stats import SpecDecodeStats

LOGGER = "pagellm.metrics.engine_metrics"


def idle_stats() -> SchedulerStats:
    return SchedulerStats(**{f.name: 0 for f in dataclasses.fields(SchedulerStats)})


def step(metrics: EngineMetrics) -> None:
    """One busy step whose end closes the stats-line window (its start moved back, so
    nothing depends on the clock)."""
    metrics._log_window.start -= 10 * metrics.log_stats_interval
    metrics.record_step(SchedulerOutput(num_scheduled_tokens={"r": 5}, total_num_scheduled_tokens=5), [], idle_stats(), 0.0)


def sample(metrics: EngineMetrics, name: str) -> float | None:
    return metrics.prom.registry.get_sample_value(f"pagellm:{name}", {"model_name": "m"})


def test_derived_figures_follow_the_counts():
    # 4 verifications of k = 4: 16 proposed, 10 accepted -> 14 tokens emitted.
    stats = SpecDecodeStats(num_verifications=4, num_proposed_tokens=16, num_accepted_tokens=10)
    assert stats.num_emitted_tokens == 14
    assert stats.acceptance_rate == pytest.approx(10 / 16)
    assert stats.mean_accepted_length == pytest.approx(14 / 4)
    assert dataclasses.asdict(stats)["mean_accepted_length"] == pytest.approx(3.5)  # stored, not a property
    empty = SpecDecodeStats()
    assert (empty.num_emitted_tokens, empty.acceptance_rate, empty.mean_accepted_length) == (0, None, None)
    assert empty.describe() == ""
    assert stats + SpecDecodeStats(1, 4, 0) == SpecDecodeStats(5, 20, 10)


def test_totals_reach_the_snapshot_and_prometheus():
    metrics = EngineMetrics("m", log_stats_interval=None)
    assert metrics.snapshot(idle_stats()).spec_decode == SpecDecodeStats()
    metrics.record_speculation(2, 8, 5)
    metrics.record_speculation(0, 0, 0)  # a step without speculation
    metrics.record_speculation(1, 3, 3)
    spec = metrics.snapshot(idle_stats()).spec_decode
    assert (spec.num_verifications, spec.num_proposed_tokens, spec.num_accepted_tokens) == (3, 11, 8)
    assert spec.num_emitted_tokens == 11
    assert spec.acceptance_rate == pytest.approx(8 / 11)
    assert spec.mean_accepted_length == pytest.approx(11 / 3)
    assert sample(metrics, "spec_decode_num_drafts_total") == 3
    assert sample(metrics, "spec_decode_num_draft_tokens_total") == 11
    assert sample(metrics, "spec_decode_num_accepted_tokens_total") == 8


def test_stats_line_shows_the_windows_speculation_only_when_there_was_some(caplog):
    metrics = EngineMetrics("m", log_stats_interval=5.0, series_interval=1e9)
    caplog.set_level(logging.INFO, logger=LOGGER)
    metrics.record_speculation(4, 16, 10)  # before the window: counted in the totals only
    step(metrics)
    caplog.clear()
    metrics.record_speculation(3, 12, 6)
    metrics.record_speculation(1, 4, 4)
    step(metrics)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speculative decoding")]
    # This window: 4 verifications, 16 proposed, 10 accepted -> 62.5%, 14 / 4 = 3.50.
    assert lines == [
        (
            "speculative decoding: acceptance rate 62.5% (10 of 16 proposed tokens accepted), "
            "mean accepted length 3.50 tokens per verification (4 verifications)"
        )
    ]
    caplog.clear()
    step(metrics)  # a busy window that did not speculate
    messages = [r.getMessage() for r in caplog.records]
    assert messages and not any("speculative" in m for m in messages)


def test_dashboard_state_carries_the_totals_once_something_was_verified():
    from types import SimpleNamespace

    from pagellm.config import CacheConfig, SchedulerConfig
    from pagellm.core.scheduler import Scheduler
    from pagellm.metrics.dashboard_state import dashboard_state

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16),
                          CacheConfig(block_size=4, num_gpu_blocks=8))  # fmt: skip
    engine = SimpleNamespace(scheduler=scheduler, metrics=EngineMetrics("m", log_stats_interval=None),
                             num_steps=0, model_name="m")  # fmt: skip
    assert dashboard_state(engine)["spec_decode"] is None
    engine.metrics.record_speculation(2, 8, 6)
    spec = dashboard_state(engine)["spec_decode"]
    assert spec["acceptance_rate"] == pytest.approx(0.75) and spec["mean_accepted_length"] == pytest.approx(4.0)
