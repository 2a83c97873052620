"""Metrics stage: per-step accounting of what the engine did, kept cheap.

The engine calls `record_step` once per step with what ran and what came out. From that
this module keeps: the Prometheus metrics (prometheus_metrics.py), per-request timings
(queue, prefill, TTFT, inter-token, end-to-end), a time series sampled every second (for
the dashboard and offline reports), a periodic stats line in the log, and a snapshot
for the offline API.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.core.scheduler_stats import FinishedRequestStats, SchedulerStats
from pagellm.core.step_batch import StepBatch
from pagellm.metrics.prometheus_metrics import PrometheusMetrics
from pagellm.metrics.spec_decode_stats import SpecDecodeStats
from pagellm.metrics.utilization import Ceilings, Utilization, step_cost
from pagellm.model.costs import ModelCosts
from pagellm.outputs import RequestMetrics, RequestOutput
from pagellm.request import child_request_id
from pagellm.workload.latency import percentile

logger = logging.getLogger(__name__)

# Scheduler counters that are mirrored as Prometheus counters (cumulative -> deltas).
_MIRRORED_COUNTERS = {
    "num_prefill_tokens": "prefill_tokens",
    "num_decode_tokens": "decode_tokens",
    "num_prefix_query_tokens": "prefix_cache_queries",
    "num_prefix_hit_tokens": "prefix_cache_hits",
    "num_swapped_in_blocks": "swapped_in_blocks",
    "num_swapped_out_blocks": "swapped_out_blocks",
    "num_allocation_attempts": "block_allocation_attempts",
    "num_allocation_failures": "block_allocation_failures",
    "num_tier_hit_blocks": "kv_tier_hit_blocks",
    "num_tier_miss_blocks": "kv_tier_miss_blocks",
    "num_tier_skipped_blocks": "kv_tier_skipped_blocks",
    "num_tier_failed_loads": "kv_tier_failed_loads",
    "num_tier_written_blocks": "kv_tier_written_blocks",
    "num_tier_written_states": "kv_tier_written_states",
    "num_tier_loaded_states": "kv_tier_loaded_states",
    "num_tier_dropped_writes": "kv_tier_dropped_writes",
    "num_tier_bytes_read": "kv_tier_read_bytes",
    "num_tier_bytes_written": "kv_tier_written_bytes",
}


@dataclass
class _RequestTiming:
    arrival: float
    num_prompt_tokens: int
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)  # per completion index
    num_preemptions: int = 0  # over its completions (the scheduler's FinishedRequestStats)
    num_tier_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class LatencySummary:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything the engine counted so far (the offline API's stats object)."""

    scheduler: SchedulerStats
    num_steps: int
    prompt_tokens: int
    generation_tokens: int
    finished_requests: dict[str, int]
    rejected_requests: dict[str, int]
    latencies: dict[str, LatencySummary]  # ttft, itl, e2e, queue_time, prefill_time, decode_time
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # zeros without speculation
    embedding_requests: int = 0  # finished with their embedding (LLM.embed, /v1/embeddings)


class _Window:
    """Counter values at the start of a reporting window, to turn totals into rates."""

    def __init__(self, now: float, totals: dict[str, float]) -> None:
        self.start = now
        self.totals = dict(totals)
        self.busy = False


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        log_stats_interval: float | None = 5.0,
        series_interval: float = 1.0,
        series_file: str | None = None,
        max_series_points: int = 3600,
        reservoir_size: int = 10000,
    ) -> None:
        self.prom = PrometheusMetrics(model_name)
        self.log_stats_interval = log_stats_interval
        self.series_interval = series_interval
        self.series: deque[dict[str, Any]] = deque(maxlen=max_series_points)
        self._series_file = open(series_file, "a", encoding="utf-8") if series_file else None  # noqa: SIM115
        self._timings: dict[str, _RequestTiming] = {}
        self._last_stats: SchedulerStats | None = None
        self._latencies: dict[str, deque[float]] = {
            name: deque(maxlen=reservoir_size)
            for name in ("ttft", "itl", "e2e", "queue_time", "prefill_time", "decode_time")
        }
        self._interval_latencies: dict[str, list[float]] = {"ttft": [], "itl": []}
        self.num_steps = 0
        self.lora_loads = 0  # LoRA adapters copied into a slot (ModelRunnerOutput's counts, summed)
        self.lora_evictions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.embedding_requests = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.spec_decode = SpecDecodeStats()
        # Work estimates for MFU / MBU (set_utilization_model), summed over busy steps.
        self._model_cost: ModelCosts | None = None
        self.ceilings: Ceilings | None = None
        self.max_num_seqs = 0
        self.estimated_flops = 0.0
        self.estimated_bytes = 0.0
        self.busy_seconds = 0.0
        self.last_utilization: Utilization | None = None
        now = time.monotonic()
        self._series_window = _Window(now, self._totals(None))
        self._log_window = _Window(now, self._totals(None))

    def set_memory(self, components: Mapping[str, int], device_type: str) -> None:
        """Rank 0's memory by component (worker/memory_report.py), for pagellm:memory_bytes."""
        self.prom.memory.set_components(components, device_type)

    def set_cpu_kernels(self, info: dict[str, str]) -> None:
        """The kernel choice of a bf16 CPU model (model/linear_plans.py kernel_info), as an info metric."""
        self.prom.cpu_kernels.info(info)

    def set_cache_shape(
        self, kv_bytes_per_token: int, state_bytes_per_request: int, num_state_slots: int, num_state_snapshots: int
    ) -> None:
        """What the cache holds per token of context (K/V) and per request (a hybrid's state)."""
        self.prom.kv_cache_bytes_per_token.set(kv_bytes_per_token)
        self.prom.state_bytes_per_request.set(state_bytes_per_request)
        self.prom.num_state_slots.set(num_state_slots)
        self.prom.num_state_snapshots.set(num_state_snapshots)

    def set_utilization_model(self, cost: ModelCosts, ceilings: Ceilings, max_num_seqs: int) -> None:
        """Turn on MFU / MBU: the model's cost constants and the device's peaks."""
        self._model_cost = cost
        self.ceilings = ceilings
        self.max_num_seqs = max_num_seqs
        self.prom.flops_ceiling.set(ceilings.flops_per_s)
        self.prom.bandwidth_ceiling.set(ceilings.bytes_per_s)

    # ------------------------------------------------------------- requests

    def request_added(self, request_id: str, num_prompt_tokens: int, arrival: float) -> None:
        self._timings[request_id] = _RequestTiming(arrival, num_prompt_tokens)

    def _timing_of(self, scheduler_id: str) -> _RequestTiming | None:
        """A request's timing by its id or, for completion i >= 1 of an n > 1 request, by
        its scheduler id (request.child_request_id: the parent's id, '#', i)."""
        timing = self._timings.get(scheduler_id)
        if timing is None and "#" in scheduler_id:
            timing = self._timings.get(scheduler_id.rpartition("#")[0])
        return timing

    def record_finished_stats(self, stats: list[FinishedRequestStats]) -> None:
        """What the scheduler says of requests it finished (preemptions, tier hits)."""
        for finished in stats:
            timing = self._timings.get(finished.request_id)
            if timing is not None:
                timing.num_preemptions += finished.num_preemptions
                timing.num_tier_tokens = max(timing.num_tier_tokens, finished.num_tier_tokens)

    def recent_mean(self, latency: str, count: int = 100) -> float | None:
        """The mean of the last `count` values of a latency (ttft, e2e, ...), None before any."""
        values = self._latencies[latency]
        recent = list(itertools.islice(reversed(values), count))
        return sum(recent) / len(recent) if recent else None

    def request_rejected(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.prom.request_rejected(reason).inc()

    def record_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Token timings and finishes, from the outputs of a step (or of an abort)."""
        prom = self.prom
        for output in outputs:
            timing = self._timings.get(output.request_id)
            if timing is None:
                continue
            for completion in output.outputs:
                count = len(completion.delta_token_ids)
                if not count:
                    continue
                self.generation_tokens += count
                prom.generation_tokens.inc(count)
                previous = timing.last_token.get(completion.index)
                if previous is not None:
                    self._observe("itl", prom.inter_token_latency, now - previous)
                timing.last_token[completion.index] = now
            if timing.first_token is None and timing.last_token:
                timing.first_token = now
                self.prompt_tokens += timing.num_prompt_tokens
                prom.prompt_tokens.inc(timing.num_prompt_tokens)
                self._observe("ttft", prom.time_to_first_token, now - timing.arrival)
                if timing.first_scheduled is not None:
                    self._observe("prefill_time", prom.request_prefill_time, now - timing.first_scheduled)
            if output.finished and output.embedding is not None:  # a prefill with nothing generated
                self.embedding_requests += 1
                prom.embedding_requests.inc()
                self.prompt_tokens += timing.num_prompt_tokens
                prom.prompt_tokens.inc(timing.num_prompt_tokens)
                if timing.first_scheduled is not None:
                    self._observe("prefill_time", prom.request_prefill_time, now - timing.first_scheduled)
            if output.finished:
                del self._timings[output.request_id]
                output.metrics = RequestMetrics(
                    timing.arrival, timing.first_scheduled, timing.first_token, now, timing.num_prompt_tokens,
                    output.num_cached_tokens, timing.num_tier_tokens, sum(len(c.token_ids) for c in output.outputs),
                    timing.num_preemptions, timing.num_draft_tokens, timing.num_accepted_tokens,
                )  # fmt: skip
                self._observe("e2e", prom.e2e_request_latency, now - timing.arrival)
                if timing.first_token is not None:
                    self._observe("decode_time", prom.request_decode_time, now - timing.first_token)
                prom.request_prompt_tokens.observe(timing.num_prompt_tokens)
                prom.request_generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
                for completion in output.outputs:
                    reason = completion.finish_reason or "abort"
                    self.finished[reason] = self.finished.get(reason, 0) + 1
                    prom.request_success(reason).inc()

    # ----------------------------------------------------------------- steps

    def record_lora(self, num_loads: int, num_evictions: int) -> None:
        """A step's LoRA adapter loads into slots and evictions from them."""
        self.lora_loads += num_loads
        self.lora_evictions += num_evictions

    def record_step(
        self,
        scheduler_output: SchedulerOutput,
        outputs: list[RequestOutput],
        stats: SchedulerStats,
        now: float,
        work: StepBatch | None = None,
        step_seconds: float = 0.0,
        started: float | None = None,
    ) -> None:
        """`work` (the step's batch) and `step_seconds` (the whole step: schedule, forward, update) feed the
        MFU / MBU estimates when a utilization model is set."""
        prom = self.prom
        self.num_steps += 1
        scheduled = scheduler_output.num_scheduled_tokens
        if work is not None and self._model_cost is not None and work.num_tokens:
            cost = step_cost(self._model_cost, work)
            self.estimated_flops += cost.flops
            self.estimated_bytes += cost.bytes
            self.busy_seconds += step_seconds
            prom.estimated_flops.inc(cost.flops)
            prom.estimated_bytes.inc(cost.bytes)
        if scheduled:
            prom.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)
            prom.iteration_requests.observe(len(scheduled))
            for request_id in scheduled:
                timing = self._timings.get(request_id)
                if timing is not None and timing.first_scheduled is None:
                    # Scheduled when the step began (`started`): its forward is prefill time.
                    timing.first_scheduled = now if started is None else started
                    self._observe("queue_time", prom.request_queue_time, timing.first_scheduled - timing.arrival)
        self._record_speculation_by_request(scheduler_output, outputs)
        self.record_outputs(outputs, now)
        self.update_scheduler_metrics(stats)
        active = bool(scheduled) or stats.num_waiting > 0
        self._series_window.busy |= active
        self._log_window.busy |= active
        monotonic = time.monotonic()
        if monotonic - self._series_window.start >= self.series_interval:
            self._append_series_point(monotonic, stats)
        if self.log_stats_interval and monotonic - self._log_window.start >= self.log_stats_interval:
            self._log_stats_line(monotonic, stats)

    def _record_speculation_by_request(self, scheduler_output: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        """Each request's draft tokens checked this step and those accepted (the tokens it
        gained beyond the one a step always yields)."""
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if not drafts:
            return
        gained = {
            output.request_id if completion.index == 0 else child_request_id(output.request_id, completion.index):
            len(completion.delta_token_ids)
            for output in outputs for completion in output.outputs
        }  # fmt: skip
        for scheduler_id, proposed in drafts.items():
            timing = self._timing_of(scheduler_id)
            if timing is not None and proposed:
                timing.num_draft_tokens += len(proposed)
                timing.num_accepted_tokens += max(0, gained.get(scheduler_id, 0) - 1)

    def record_structured_outputs(self, compile_seconds: list[float], cache_hits: int, mask_seconds: float) -> None:
        """Constraints compiled and found cached since the last call; this step's mask time
        (0: no constrained request sampled)."""
        for seconds in compile_seconds:
            self.prom.grammar_compile_seconds.observe(seconds)
        if cache_hits:
            self.prom.grammar_cache_hits.inc(cache_hits)
        if mask_seconds > 0:
            self.prom.structured_mask_seconds.observe(mask_seconds)

    def record_failed_step(self, num_requests: int) -> None:
        self.prom.failed_steps.inc()
        if num_requests:
            self.prom.request_failures.inc(num_requests)

    def record_speculation(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Speculative verifications since the last call (acceptance rate = accepted / draft tokens)."""
        if num_drafts:
            self.spec_decode += SpecDecodeStats(num_drafts, num_draft_tokens, num_accepted_tokens)
            self.prom.spec_decode_num_drafts.inc(num_drafts)
            self.prom.spec_decode_num_draft_tokens.inc(num_draft_tokens)
            self.prom.spec_decode_num_accepted_tokens.inc(num_accepted_tokens)
            self.prom.spec_decode_num_emitted_tokens.inc(num_accepted_tokens + num_drafts)

    def update_scheduler_metrics(self, stats: SchedulerStats) -> None:
        """Gauges from a scheduler snapshot, and its counters' growth since the last one."""
        prom = self.prom
        prom.num_requests_running.set(stats.num_running)
        prom.num_requests_waiting.set(stats.num_waiting)
        prom.num_requests_swapped.set(stats.num_swapped)
        prom.kv_cache_usage_perc.set(stats.kv_cache_usage)
        prom.cpu_kv_cache_usage_perc.set(stats.host_kv_cache_usage)
        prom.num_free_blocks.set(stats.num_free_blocks)
        last = self._last_stats
        for field_name, metric_name in _MIRRORED_COUNTERS.items():
            delta = getattr(stats, field_name) - (getattr(last, field_name) if last else 0)
            if delta:
                getattr(prom, metric_name).inc(delta)
        prom.kv_tier_bytes.set(stats.tier_bytes)
        num_batches = stats.num_tier_load_batches - (last.num_tier_load_batches if last else 0)
        if num_batches:  # one batch a step, and a snapshot every step: the batch's own time
            seconds = stats.tier_load_seconds - (last.tier_load_seconds if last else 0.0)
            for _ in range(num_batches):
                prom.kv_tier_load_seconds.observe(seconds / num_batches)
        for mode in ("recompute", "swap"):
            field_name = f"num_preemptions_{mode}"
            delta = getattr(stats, field_name) - (getattr(last, field_name) if last else 0)
            if delta:
                prom.preemptions[mode].inc(delta)
        self._last_stats = stats

    def _observe(self, name: str, histogram: Any, value: float) -> None:
        histogram.observe(value)
        self._latencies[name].append(value)
        if name in self._interval_latencies:
            self._interval_latencies[name].append(value)

    # -------------------------------------------------------------- reports

    def _totals(self, stats: SchedulerStats | None) -> dict[str, float]:
        totals: dict[str, float] = {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "steps": self.num_steps,
            "flops": self.estimated_flops,
            "bytes": self.estimated_bytes,
            "busy_seconds": self.busy_seconds,
            "spec_verifications": self.spec_decode.num_verifications,
            "spec_proposed": self.spec_decode.num_proposed_tokens,
            "spec_accepted": self.spec_decode.num_accepted_tokens,
        }
        for field_name in (*_MIRRORED_COUNTERS, "num_preemptions_recompute", "num_preemptions_swap"):
            totals[field_name] = getattr(stats, field_name) if stats else 0
        return totals

    def _rates(self, window: _Window, now: float, stats: SchedulerStats) -> dict[str, float]:
        elapsed = max(now - window.start, 1e-9)
        totals = self._totals(stats)
        delta = {k: totals[k] - window.totals.get(k, 0) for k in totals}
        queries = delta["num_prefix_query_tokens"]
        attempts = delta["num_allocation_attempts"]
        return {
            "elapsed": elapsed,
            "prompt_tps": delta["prompt_tokens"] / elapsed,
            "generation_tps": delta["generation_tokens"] / elapsed,
            "prefill_tps": delta["num_prefill_tokens"] / elapsed,
            "decode_tps": delta["num_decode_tokens"] / elapsed,
            "steps_per_s": delta["steps"] / elapsed,
            "prefix_hit_rate": delta["num_prefix_hit_tokens"] / queries if queries else 0.0,
            "allocation_failure_rate": delta["num_allocation_failures"] / attempts if attempts else 0.0,
            "preemptions": delta["num_preemptions_recompute"] + delta["num_preemptions_swap"],
            **self._window_utilization(delta),
            **_window_speculation(delta),
        }

    def _window_utilization(self, delta: dict[str, float]) -> dict[str, float]:
        """MFU / MBU over a window: its estimated work over its busy step time. A rate
        above a ceiling means the ceiling read low (measured while the machine was busy):
        the ceiling rises to that rate, so utilization never reads above 100%."""
        ceilings = self.ceilings
        if ceilings is None or delta["busy_seconds"] <= 0:
            return {}
        seconds = delta["busy_seconds"]
        flops_per_s, bytes_per_s = delta["flops"] / seconds, delta["bytes"] / seconds
        if flops_per_s > ceilings.flops_per_s or bytes_per_s > ceilings.bytes_per_s:
            raised = Ceilings(
                max(ceilings.flops_per_s, flops_per_s), max(ceilings.bytes_per_s, bytes_per_s),
                f"{ceilings.source}, raised to achieved rates",
            )  # fmt: skip
            logger.warning(
                "the engine ran faster than the device ceilings measured at start (%.0f GFLOP/s, %.1f GB/s: "
                "measured on a busy machine?); they are now %.0f GFLOP/s and %.1f GB/s",
                ceilings.flops_per_s / 1e9, ceilings.bytes_per_s / 1e9, raised.flops_per_s / 1e9, raised.bytes_per_s / 1e9,
            )  # fmt: skip
            self.ceilings = ceilings = raised
            self.prom.flops_ceiling.set(raised.flops_per_s)
            self.prom.bandwidth_ceiling.set(raised.bytes_per_s)
        return {"mfu": flops_per_s / ceilings.flops_per_s, "mbu": bytes_per_s / ceilings.bytes_per_s}

    def _append_series_point(self, now: float, stats: SchedulerStats) -> None:
        window = self._series_window
        rates = self._rates(window, now, stats)
        point = {
            "time": time.time(),
            **{k: round(v, 4) for k, v in rates.items() if k != "elapsed"},
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "swapped": stats.num_swapped,
            "kv_usage": round(stats.kv_cache_usage, 4),
            "ttft_p50": _percentile(self._interval_latencies["ttft"], 50),
            "ttft_p90": _percentile(self._interval_latencies["ttft"], 90),
            "itl_p50": _percentile(self._interval_latencies["itl"], 50),
            "itl_p90": _percentile(self._interval_latencies["itl"], 90),
        }
        for values in self._interval_latencies.values():
            values.clear()
        if "mfu" in rates:
            self.last_utilization = Utilization(rates["mfu"], rates["mbu"])
            self.prom.model_flops_utilization.set(rates["mfu"])
            self.prom.memory_bandwidth_utilization.set(rates["mbu"])
        if window.busy:
            self.series.append(point)
            if self._series_file is not None:
                self._series_file.write(json.dumps(point) + "\n")
                self._series_file.flush()
        self._series_window = _Window(now, self._totals(stats))

    def _log_stats_line(self, now: float, stats: SchedulerStats) -> None:
        window = self._log_window
        if window.busy:
            r = self._rates(window, now, stats)
            ratio = r["prefill_tps"] / r["decode_tps"] if r["decode_tps"] else float("inf")
            logger.info(
                "prompt %.1f tok/s, generation %.1f tok/s | prefill %.1f tok/s, decode %.1f tok/s "
                "(prefill:decode %.2f) | running %d, waiting %d, swapped %d | KV %.1f%% | "
                "prefix hit %.1f%% | alloc failures %.1f%% | preemptions %d",
                r["prompt_tps"], r["generation_tps"], r["prefill_tps"], r["decode_tps"], ratio,
                stats.num_running, stats.num_waiting, stats.num_swapped,
                100 * stats.kv_cache_usage, 100 * r["prefix_hit_rate"],
                100 * r["allocation_failure_rate"], r["preemptions"],
            )  # fmt: skip
            if "mfu" in r:
                used = Utilization(r["mfu"], r["mbu"])
                hint = used.hint(stats.num_running, stats.num_waiting, self.max_num_seqs)
                logger.info("%s%s", used.describe(), f" | hint: {hint}" if hint else "")
            if "spec_verifications" in r:
                window_spec = SpecDecodeStats(
                    int(r["spec_verifications"]), int(r["spec_proposed"]), int(r["spec_accepted"])
                )
                logger.info("speculative decoding: %s", window_spec.describe())
        self._log_window = _Window(now, self._totals(stats))

    def snapshot(self, stats: SchedulerStats) -> MetricsSnapshot:
        return MetricsSnapshot(
            scheduler=stats,
            num_steps=self.num_steps,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            finished_requests=dict(self.finished),
            rejected_requests=dict(self.rejected),
            latencies={name: latency_summary(values) for name, values in self._latencies.items()},
            spec_decode=self.spec_decode,
            embedding_requests=self.embedding_requests,
        )

    def close(self) -> None:
        if self._series_file is not None:
            self._series_file.close()
            self._series_file = None


def _window_speculation(delta: dict[str, float]) -> dict[str, float]:
    """A window's verifications, their tokens, acceptance rate and mean accepted length
    (nothing when no step speculated, so idle or non-speculating windows stay quiet)."""
    verifications = delta["spec_verifications"]
    if not verifications:
        return {}
    window = SpecDecodeStats(int(verifications), int(delta["spec_proposed"]), int(delta["spec_accepted"]))
    assert window.mean_accepted_length is not None
    return {
        "spec_verifications": window.num_verifications,
        "spec_proposed": window.num_proposed_tokens,
        "spec_accepted": window.num_accepted_tokens,
        "spec_acceptance_rate": window.acceptance_rate or 0.0,
        "spec_mean_accepted_length": window.mean_accepted_length,
    }


def _percentile(values: list[float] | deque[float], q: float) -> float | None:
    """The engine's percentiles are the benchmarks' (workload/latency.py), None of nothing."""
    return percentile(sorted(values), q) if values else None


def latency_summary(values: deque[float] | list[float]) -> LatencySummary:
    """count, mean and percentiles of latencies in seconds (zeros for none)."""
    if not values:
        return LatencySummary(0, 0.0, 0.0, 0.0, 0.0)
    return LatencySummary(
        count=len(values),
        mean=sum(values) / len(values),
        p50=_percentile(values, 50) or 0.0,
        p90=_percentile(values, 90) or 0.0,
        p99=_percentile(values, 99) or 0.0,
    )

