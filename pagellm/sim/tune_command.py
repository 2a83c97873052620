"""Simulation stage: `pagellm tune`, a grid of engine arguments simulated and ranked.

Prints the ranked table, the recommended engine arguments as a ready command line, one
JSON line (appended to --result-file), and draws throughput against latency (PNG).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from typing import Any

from pagellm.errors import ConfigError, PagellmError
from pagellm.sim.sim_args import TUNED_KNOBS, add_sim_engine_args, add_sim_workload_args, add_target_args
from pagellm.sim.tune import GOALS, LATENCY_METRICS, default_jobs

logger = logging.getLogger(__name__)

# Results kept per grid point in the JSON line (the full simulate record is much larger).
_POINT_FIELDS = (
    "num_requests", "completed", "rejected", "requests_per_s", "output_tok_s", "ttft_ms_median", "ttft_ms_p99",
    "itl_ms_median", "itl_ms_p99", "tpot_ms_median", "e2el_ms_p99", "kv_usage_mean",
    "kv_usage_max", "num_preemptions", "num_allocation_failures", "kv_capacity_tokens",
    "num_steps", "sim_wall_s",
)  # fmt: skip


def add_tune_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "tune",
        help="simulate a grid of engine arguments and recommend the best for a goal",
        description="Sweep max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, "
        "max_model_len, block_size and the prefill/decode balance knobs (each flag takes "
        "several values) over one simulated workload, rank the configurations for a goal, "
        "and print the winner as a command line.",
    )
    add_target_args(p)
    add_sim_workload_args(p)
    add_sim_engine_args(p, sweep=True)
    goal = p.add_argument_group("goal")
    goal.add_argument("--goal", choices=GOALS, default="throughput",
                      help="throughput: most output tok/s within the latency limits; "
                      "latency: lowest --latency-metric at the workload's rate")
    goal.add_argument("--max-p99-ttft-ms", type=float, default=None, help="latency limit")
    goal.add_argument("--max-p99-itl-ms", type=float, default=None, help="latency limit")
    goal.add_argument("--latency-metric", choices=LATENCY_METRICS, default="ttft_p99",
                      help="what --goal latency minimizes, and the chart's x axis")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"simulations run in parallel (default: CPU count, {default_jobs()} here)")
    p.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    p.add_argument("--plot", default="pagellm-tune.png",
                   help="PNG chart of throughput against latency ('' = none)")
    p.add_argument("--result-file", default="", help="append the JSON line here")
    p.set_defaults(run_command=run_tune)
    return p  # fmt: skip


def run_tune(args: argparse.Namespace) -> dict[str, Any]:
    from pagellm.sim.runs import target_from_args, workload_from_args
    from pagellm.sim.sim_args import engine_args_from
    from pagellm.sim.simulate_command import append_json_line
    from pagellm.sim.tune import DEFAULT_GRID, TuneGoal, grid_points, rank, run_grid

    jobs = default_jobs() if args.jobs is None else args.jobs
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    goal = TuneGoal(args.goal, args.max_p99_ttft_ms, args.max_p99_itl_ms, args.latency_metric)
    target = target_from_args(args)
    values: dict[str, tuple[Any, ...]] = {}
    for name in TUNED_KNOBS:
        given = getattr(args, name)
        if given:
            values[name] = tuple(dict.fromkeys(given))  # drop repeats, keep order
        elif name in DEFAULT_GRID:
            values[name] = DEFAULT_GRID[name]
    if target.gpu is None and "gpu_memory_utilization" in values:
        raise ConfigError(
            "--gpu-memory-utilization has no effect with --calibration (the CPU's KV budget is "
            "fixed; use --kv-cache-memory-bytes)"
        )
    base = engine_args_from(args)
    points = grid_points(values)
    longest = max(values.get("max_model_len", (base.max_model_len or target.model_config.max_position_embeddings,)))
    workload = workload_from_args(args, longest)
    logger.info("simulating %d configurations of %s on %s (%d jobs)", len(points),
                target.model_name, target.device_name, jobs)  # fmt: skip
    start = time.perf_counter()
    simulate_point = _PointSimulator(target, base, workload.requests)
    ranked = rank(run_grid(points, simulate_point, jobs), goal)
    wall = time.perf_counter() - start
    record = _make_record(target, workload, goal, values, ranked, wall)
    print(json.dumps(record))
    print_ranking(record, args.top)
    if args.plot:
        from pagellm.sim.tune_chart import draw_tune_chart

        message = draw_tune_chart(record, args.plot)
        print(message)
    if args.result_file:
        append_json_line(args.result_file, record)
    return record


class _PointSimulator:
    """Simulates one grid point (picklable state, so forked workers can run it)."""

    def __init__(self, target: Any, base: Any, requests: list[Any]) -> None:
        self.target = target
        self.base = base
        self.requests = requests

    def __call__(self, knobs: dict[str, Any]) -> Any:
        from pagellm.sim.runs import engine_description, simulate
        from pagellm.sim.tune import TunePoint, engine_args_for

        try:
            run = simulate(self.target, engine_args_for(self.base, knobs), self.requests)
        except PagellmError as e:
            return TunePoint(knobs, None, error=str(e))
        summary = {name: run.summary[name] for name in _POINT_FIELDS}
        return TunePoint(knobs, summary, engine_description(run, self.target))


def _make_record(target: Any, workload: Any, goal: Any, values: dict[str, Any],
                 ranked: list[Any], wall_s: float) -> dict[str, Any]:
    from pagellm.sim.tune import command_line, violations

    best = ranked[0] if ranked and ranked[0].valid else None
    recommended = None
    if best is not None:
        recommended = {
            "knobs": best.knobs,
            "engine": best.engine,
            "meets_goal": not violations(best, goal),
            "command": command_line(target.model_name, best.engine),
        }
    return {
        "bench": "tune",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cost_model": {"name": target.cost_model.name, **target.cost_model.describe()},
        "target": {"model": target.model_name, "device": target.device_name},
        "goal": {"goal": goal.goal, "max_p99_ttft_ms": goal.max_p99_ttft_ms,
                 "max_p99_itl_ms": goal.max_p99_itl_ms, "latency_metric": goal.latency_metric},
        "grid": {name: list(v) for name, v in values.items()},
        "workload": workload.description,
        "points": [
            {"rank": i + 1, "knobs": p.knobs, "engine": p.engine, "results": p.summary,
             "error": p.error, "misses": violations(p, goal) if p.valid else []}
            for i, p in enumerate(ranked)
        ],
        "recommended": recommended,
        "wall_s": round(wall_s, 2),
    }  # fmt: skip


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


def print_ranking(record: dict[str, Any], top: int) -> None:
    swept = list(record["grid"])
    metric = record["goal"]["latency_metric"]
    metric_key = "{}_ms_{}".format(*metric.split("_"))
    headers = ["#", *swept, "out tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p99"]
    if metric_key not in ("ttft_ms_median", "ttft_ms_p99", "itl_ms_p99"):
        headers.append(f"{metric} ms")
    headers += ["KV mean", "preempt", "status"]
    rows = []
    for point in record["points"][:top]:
        r = point["results"]
        knobs = [_fmt(point["knobs"][name], 2) for name in swept]
        if r is None:
            rows.append([str(point["rank"]), *knobs] + ["-"] * (len(headers) - len(knobs) - 2)
                        + [f"invalid: {point['error']}"])  # fmt: skip
            continue
        row = [str(point["rank"]), *knobs, _fmt(r["output_tok_s"]), _fmt(r["requests_per_s"], 2),
               _fmt(r["ttft_ms_median"]), _fmt(r["ttft_ms_p99"]), _fmt(r["itl_ms_p99"])]  # fmt: skip
        if metric_key not in ("ttft_ms_median", "ttft_ms_p99", "itl_ms_p99"):
            row.append(_fmt(r.get(metric_key)))
        row += [f"{r['kv_usage_mean']:.0%}", str(r["num_preemptions"]),
                "ok" if not point["misses"] else "; ".join(point["misses"])]  # fmt: skip
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(f"{record['target']['model']} on {record['target']['device']} ({record['cost_model']['name']}); "
          f"{record['workload']['description']}; goal: {record['goal']['goal']}")  # fmt: skip
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(cell.rjust(w) if i < len(row) - 1 else cell for i, (cell, w) in enumerate(zip(row, widths))))
    if len(record["points"]) > top:
        print(f"... {len(record['points']) - top} more in the JSON line")
    recommended = record["recommended"]
    if recommended is None:
        print("no valid configuration: every one was refused (see status)")
        return
    if not recommended["meets_goal"]:
        print("no configuration meets every requirement; the closest is:")
    print(f"recommended: {recommended['command']}")
