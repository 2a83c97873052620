"""Workload stage: the latency names and the statistics both
report them with (definitions in pagellm/bench/serve_metrics.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default method); `sorted_values` must be sorted and non-empty."""
    assert sorted_values, "percentile of nothing"
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def describe_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 of values given in seconds, in milliseconds."""
    if not values_s:
        return {"mean": None, **{name: None for name, _ in PERCENTILES}}
    ordered = sorted(v * 1000.0 for v in values_s)
    stats: dict[str, float | None] = {"mean": round(sum(ordered) / len(ordered), 3)}
    for name, q in PERCENTILES:
        stats[name] = round(percentile(ordered, q), 3)
    return stats
