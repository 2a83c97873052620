"""Bench stage: what one `pagellm bench serve` request measured, and the run's summary.

Pure functions over plain records, so that the aggregation (percentiles, goodput under
SLOs, throughput) is tested on crafted records without a server.

Times of a request (seconds):
- `scheduled_s`, `sent_s`, `end_s`: from the benchmark's start. A request is sent at its
  scheduled arrival, or later when --max-concurrency makes it wait for a free slot.
- TTFT: from sending the request to receiving the first stream chunk that carries
  generated tokens (chat's opening role-only chunk does not count).
- E2EL: from sending the request to the end of its stream.
- ITL: the gaps between successive token-carrying chunks (one chunk = one engine step,
  usually one token).
- TPOT: (last token chunk - first token chunk) / (output tokens - 1); undefined for a
  request with fewer than two output tokens, which then meets any TPOT SLO.
Latencies are measured from sending, not from the scheduled arrival, so client-side
waiting for a concurrency slot is not charged to the server (it shows in the timeline).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagellm.errors import ConfigError
from pagellm.workload.latency import LATENCY_METRICS, describe_ms

SLO_METRICS = ("ttft", "tpot", "e2el")
MAX_ERROR_KINDS = 5  # distinct error messages kept in the summary


@dataclass
class RequestRecord:
    index: int
    prompt_len: int  # tokens sent (ids), or the ids the text was made from
    expected_output_len: int  # max_tokens asked for (exact with ignore_eos)
    scheduled_s: float
    sent_s: float = 0.0
    end_s: float = 0.0
    success: bool = False
    error: str | None = None
    ttft_s: float | None = None
    # Arrival of each token-carrying chunk, seconds after sending.
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_from_usage: bool = False  # else counted from chunks
    prompt_tokens: int = 0  # the server's usage count when given, else prompt_len

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2 or len(self.chunk_times_s) < 1:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]


def parse_goodput_slos(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:0.5", "tpot:0.05"]` -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ConfigError(
                f"--goodput takes NAME:SECONDS with NAME one of {', '.join(SLO_METRICS)}, "
                f"got {item!r}"
            )
        try:
            seconds = float(value)
        except ValueError:
            raise ConfigError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ConfigError(f"--goodput {item!r}: the SLO must be a positive number of seconds")
        slos[name] = seconds
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    if not record.success:
        return False
    if "ttft" in slos and (record.ttft_s is None or record.ttft_s > slos["ttft"]):
        return False
    tpot = record.tpot_s
    if "tpot" in slos and tpot is not None and tpot > slos["tpot"]:
        return False
    return not ("e2el" in slos and record.e2el_s > slos["e2el"])


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """The run's results as a flat JSON-ready dict (latencies in ms, rates per second)."""
    slos = slos or {}
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)

    def per_s(count: float) -> float | None:
        return round(count / duration_s, 3) if duration_s > 0 else None

    summary: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "duration_s": round(duration_s, 3),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_s": per_s(len(done)),
        "output_tok_s": per_s(output_tokens),
        "total_tok_s": per_s(input_tokens + output_tokens),
        # With ignore_eos every completed request should have exactly what it asked for;
        # a count here means the server stopped early or counted differently.
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_len for r in done),
        "output_tokens_from_usage": sum(r.output_tokens_from_usage for r in done),
    }
    values: dict[str, list[float]] = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [t for r in done if (t := r.tpot_s) is not None],
        "itl": [gap for r in done for gap in r.itls_s],
        "e2el": [r.e2el_s for r in done],
    }
    for metric in LATENCY_METRICS:
        for stat, value in describe_ms(values[metric]).items():
            summary[f"{metric}_ms_{stat}"] = value
    num_good = sum(meets_slos(r, slos) for r in records) if slos else None
    summary["slos_s"] = dict(slos)
    summary["good_requests"] = num_good
    summary["goodput_req_s"] = per_s(num_good) if num_good is not None else None
    errors = Counter(r.error or "unknown error" for r in failed)
    summary["errors"] = dict(errors.most_common(MAX_ERROR_KINDS))
    return summary
