"""Sim stage: a simulation's results, as `pagellm bench serve` reports a real run.

Latency names and definitions follow pagellm/bench/serve_metrics.py (names and statistics
from pagellm/workload/latency.py), measured from each
request's arrival (the simulated client sends at once): TTFT to the end of the step that
sampled its first token, ITL between consecutive tokens, TPOT = (last - first token) /
(tokens - 1), E2EL to the last token (with speculation a step may emit several tokens of
a request: one ITL gap, as a streaming client sees one chunk). On top: KV usage over time, preemptions,
allocation failures, the prefill/decode split, and what contiguous per-request
allocation of max_model_len would have reserved against what paged blocks did, and with
speculation the acceptance assumed next to what the verifications came to.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from pagellm.sim.simulator import SimResult
from pagellm.workload.latency import LATENCY_METRICS, PERCENTILES, describe_ms

# Points of the KV usage series kept in the JSON record.
MAX_SERIES_POINTS = 120


def describe_ms_many(values_s: Any) -> dict[str, float | None]:
    """describe_ms for millions of values (numpy; the same linear interpolation)."""
    import numpy as np

    if len(values_s) == 0:
        return {"mean": None, **{name: None for name, _ in PERCENTILES}}
    values = np.asarray(values_s, dtype=np.float64) * 1000.0  # array('d') without a copy
    stats: dict[str, float | None] = {"mean": round(float(values.mean()), 3)}
    points = np.percentile(values, [q for _, q in PERCENTILES])
    for (name, _), value in zip(PERCENTILES, points):
        stats[name] = round(float(value), 3)
    return stats


def _per_s(count: float, seconds: float) -> float | None:
    return round(count / seconds, 3) if seconds > 0 else None


def summarize_sim(result: SimResult) -> dict[str, Any]:
    """The simulation's results as a flat, JSON-ready dict."""
    done = [r for r in result.requests if r.finish_s is not None]
    rejected = Counter(r.rejected for r in result.requests if r.rejected is not None)
    input_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    duration = result.duration_s
    summary: dict[str, Any] = {
        "num_requests": len(result.requests),
        "completed": len(done),
        "rejected": sum(rejected.values()),
        "rejected_by_parameter": dict(rejected),
        "duration_s": round(duration, 3),
        "busy_s": round(result.busy_s, 3),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_s": _per_s(len(done), duration),
        "output_tok_s": _per_s(output_tokens, duration),
        "total_tok_s": _per_s(input_tokens + output_tokens, duration),
    }
    values: dict[str, list[float]] = {
        "ttft": [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None],
        "tpot": [
            (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
            for r in done
            if r.first_token_s is not None and r.finish_s is not None and r.num_output_tokens > 1
        ],
        "e2el": [r.finish_s - r.arrival_s for r in done if r.finish_s is not None],
    }
    for metric in LATENCY_METRICS:
        stats = describe_ms_many(result.itl_s) if metric == "itl" else describe_ms(values[metric])
        for stat, value in stats.items():
            summary[f"{metric}_ms_{stat}"] = value
    stats = result.stats
    summary.update({
        "num_preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap,
        "num_preemptions_recompute": stats.num_preemptions_recompute,
        "num_preemptions_swap": stats.num_preemptions_swap,
        "num_allocation_attempts": stats.num_allocation_attempts,
        "num_allocation_failures": stats.num_allocation_failures,
        "num_prefill_tokens": stats.num_prefill_tokens,
        "num_decode_tokens": stats.num_decode_tokens,
        "prefill_decode_ratio": (
            round(stats.num_prefill_tokens / stats.num_decode_tokens, 4)
            if stats.num_decode_tokens else None
        ),
        "prefix_hit_rate": (
            round(stats.num_prefix_hit_tokens / stats.num_prefix_query_tokens, 4)
            if stats.num_prefix_query_tokens else None
        ),
        "tier_hit_blocks": stats.num_tier_hit_blocks,
        "tier_skipped_blocks": stats.num_tier_skipped_blocks,
        "tier_bytes_read": stats.num_tier_bytes_read,
        "tier_bytes": stats.tier_bytes,
    })  # fmt: skip
    summary.update(_kv_summary(result))
    if result.speculation is not None:
        summary["spec_decode"] = _spec_summary(result)
    summary.update({
        "num_steps": result.num_steps,
        "num_extrapolated_steps": result.num_extrapolated_steps,
        "sim_wall_s": round(result.wall_s, 3),
        "simulated_steps_per_s": _per_s(result.num_steps, result.wall_s),
    })  # fmt: skip
    return summary


def _kv_summary(result: SimResult) -> dict[str, Any]:
    samples = result.kv_samples
    cache = result.cache_config
    capacity_tokens = cache.max_num_cached_tokens
    max_model_len = result.scheduler_config.max_model_len
    usage = sorted(s.usage for s in samples) or [0.0]
    logical = sum(s.logical_tokens for s in samples)
    paged = sum(s.paged_tokens for s in samples)
    contiguous = sum(s.contiguous_tokens for s in samples)
    running = [s.num_running for s in samples] or [0]
    step = max(1, math.ceil(len(samples) / MAX_SERIES_POINTS))
    return {
        "kv_capacity_tokens": capacity_tokens,
        "kv_usage_mean": round(sum(usage) / len(usage), 4),
        "kv_usage_median": round(usage[len(usage) // 2], 4),
        "kv_usage_max": round(usage[-1], 4),
        # [seconds, usage, running, waiting], every kv_usage_series_interval_s.
        "kv_usage_series": [
            [round(s.time_s, 3), round(s.usage, 4), s.num_running, s.num_waiting]
            for s in samples[::step]
        ],
        "kv_usage_series_interval_s": round(result.kv_sample_interval_s * step, 4),
        "running_mean": round(sum(running) / len(running), 2),
        "running_max": max(running),
        "kv_waste": {
            # Time averages of tokens: held as KV by running requests (logical), held in
            # the blocks they own (paged), and what reserving max_model_len per running
            # request would take (contiguous).
            "mean_logical_tokens": round(logical / len(samples), 1) if samples else 0.0,
            "mean_paged_tokens": round(paged / len(samples), 1) if samples else 0.0,
            "mean_contiguous_tokens": round(contiguous / len(samples), 1) if samples else 0.0,
            "paged_waste_frac": round(max(0.0, 1 - logical / paged), 4) if paged else None,
            "contiguous_waste_frac": round(1 - logical / contiguous, 4) if contiguous else None,
            # The same memory in max_model_len slabs holds this many requests at once.
            "contiguous_max_concurrency": cache.num_usable_gpu_blocks
            // cache.max_blocks_per_request(max_model_len, result.scheduler_config.max_num_batched_tokens),
            "paged_max_concurrency_seen": max(running),
        },
    }


def _spec_summary(result: SimResult) -> dict[str, Any]:
    """The assumption (k, A and what they imply for full-length proposals) and the
    verifications' totals and figures, named as the engine's get_metrics() names them."""
    assert result.speculation is not None and result.spec_decode is not None
    observed = result.spec_decode
    return {
        **result.speculation.describe(),
        "num_verifications": observed.num_verifications,
        "num_proposed_tokens": observed.num_proposed_tokens,
        "num_accepted_tokens": observed.num_accepted_tokens,
        "num_emitted_tokens": observed.num_emitted_tokens,
        "acceptance_rate": None if observed.acceptance_rate is None else round(observed.acceptance_rate, 4),
        "mean_accepted_length": (
            None if observed.mean_accepted_length is None else round(observed.mean_accepted_length, 4)
        ),
    }


def _spec_line(spec: dict[str, Any]) -> str:
    limit = spec["disable_by_batch_size"]
    assumed = (
        f"k={spec['num_speculative_tokens']}, A={spec['acceptance_rate_assumed']:g} per proposal"
        f"{'' if limit is None else f', off above {limit} running'} (expected for k proposals: "
        f"acceptance rate {spec['expected_acceptance_rate']:.1%}, "
        f"{spec['expected_mean_accepted_length']:.2f} tokens per verification)"
    )
    if not spec["num_verifications"]:
        return f"{assumed}; no step speculated"
    return (
        f"{assumed}; observed: acceptance rate {spec['acceptance_rate']:.1%} "
        f"({spec['num_accepted_tokens']} of {spec['num_proposed_tokens']} proposed), "
        f"{spec['mean_accepted_length']:.2f} tokens per verification "
        f"({spec['num_verifications']} verifications)"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_sim_table(record: dict[str, Any]) -> None:
    """The record as aligned lines on stdout (--json prints the full record instead)."""
    s = record["results"]
    waste = s["kv_waste"]
    engine = record["engine"]
    parallel = record.get("parallel", {})
    replicas = parallel.get("data_parallel_size", 1)
    blocks = record["kv_cache"]["num_gpu_blocks"] - 1
    rows: list[tuple[str, Any]] = [
        ("cost model", record["cost_model"]["name"]),
        ("engine", " ".join(f"{k}={v}" for k, v in engine.items())),
        ("KV cache", f"{f'{replicas} replicas x ' if replicas > 1 else ''}{blocks} blocks = "
                     f"{s['kv_capacity_tokens']} tokens ({record['kv_cache']['how']})"),
        ("workload", record["workload"]["description"]),
        ("requests", f"{s['completed']} completed, {s['rejected']} rejected"),
        ("duration", f"{s['duration_s']:.2f} s simulated ({s['busy_s']:.2f} s busy)"),
        ("requests/s", s["requests_per_s"]),
        ("output tok/s", s["output_tok_s"]),
        ("total tok/s", s["total_tok_s"]),
        ("KV usage", f"mean {s['kv_usage_mean']:.1%}, median {s['kv_usage_median']:.1%}, "
                     f"max {s['kv_usage_max']:.1%}"),
        ("running requests", f"mean {s['running_mean']}, max {s['running_max']}"),
        ("preemptions", f"{s['num_preemptions']} ({s['num_preemptions_recompute']} recompute, "
                        f"{s['num_preemptions_swap']} swap)"),
        ("allocation failures", f"{s['num_allocation_failures']} of "
                                f"{s['num_allocation_attempts']} attempts"),
        ("prefill / decode tokens", f"{s['num_prefill_tokens']} / {s['num_decode_tokens']} "
                                    f"(ratio {s['prefill_decode_ratio']})"),
        ("prefix cache hit rate", "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.1%}"),
        ("disk tier", f"{s['tier_hit_blocks']} blocks loaded ({s['tier_bytes_read'] / 1e9:.2f} GB), "
                      f"{s['tier_skipped_blocks']} computed instead; {s['tier_bytes'] / 1e9:.2f} GB held at the end"),
        ("KV held vs reserved", _waste_line(waste)),
        ("contiguous slabs", f"the cache would hold {waste['contiguous_max_concurrency']} requests "
                             f"of max_model_len at once; paging ran up to "
                             f"{waste['paged_max_concurrency_seen']}"),
        ("simulation", f"{s['num_steps']} steps in {s['sim_wall_s']:.2f} s "
                       f"({s['simulated_steps_per_s']} steps/s)"),
    ]  # fmt: skip
    if parallel.get("num_gpus", 1) > 1:
        rows.insert(1, ("parallelism", _parallel_line(parallel)))
    if "spec_decode" in s:
        rows.insert(len(rows) - 1, ("speculative decoding", _spec_line(s["spec_decode"])))
    if s["num_extrapolated_steps"]:
        rows.append(("extrapolated steps", f"{s['num_extrapolated_steps']} beyond the calibrated range"))
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"{'(ms)':<{width}}  {'mean':>10} {'median':>10} {'p90':>10} {'p99':>10}")
    for metric in LATENCY_METRICS:
        stats = [_ms(s[f"{metric}_ms_{stat}"]) for stat in ("mean", "median", "p90", "p99")]
        print(f"{metric.upper():<{width}}  " + " ".join(f"{x:>10}" for x in stats))


def _waste_line(waste: dict[str, Any]) -> str:
    if not waste["mean_paged_tokens"]:
        return "-"
    paged = waste["paged_waste_frac"]
    contiguous = waste["contiguous_waste_frac"]
    return (
        f"KV {waste['mean_logical_tokens']:.0f} tokens on average; paged blocks reserve "
        f"{waste['mean_paged_tokens']:.0f} ({paged:.1%} wasted), max_model_len slabs "
        f"would reserve {waste['mean_contiguous_tokens']:.0f} ({contiguous:.1%} wasted)"
    )


def _parallel_line(parallel: dict[str, Any]) -> str:
    tp, dp = parallel["tensor_parallel_size"], parallel["data_parallel_size"]
    line = f"{parallel['num_gpus']} GPUs: {dp} replica{'s' if dp > 1 else ''} x TP={tp}"
    if tp > 1:
        line += (f" over {parallel['interconnect']} ({parallel['interconnect_unidirectional_gbs']:g} GB/s "
                 f"per direction x {parallel['allreduce_efficiency']:g}, "
                 f"{parallel['allreduce_latency_us']:g} us per all-reduce)")  # fmt: skip
    if dp > 1:
        line += f"; requests routed {parallel['routing']}"
    return line
