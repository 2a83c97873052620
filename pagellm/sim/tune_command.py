"""Sim stage: `pagellm tune`, a grid of engine arguments simulated and ranked.

Prints the ranked table and the recommended engine arguments as a ready command line (or,
with --json, the full record as one JSON document), appends the record as a JSON line to
--result-file, and draws throughput against latency (PNG). A progress bar (configurations
done / total) goes to stderr when it is a terminal.
With --num-gpus N the grid is the deployment layouts of N GPUs (tune_layouts.py), each
crossed with whatever engine knobs were given several values.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from typing import Any

from pagellm.errors import ConfigError, PagellmError
from pagellm.sim.command_args import (
    TUNED_KNOBS,
    add_parallel_args,
    add_sim_engine_args,
    add_sim_workload_args,
    add_target_args,
)
from pagellm.sim.tune import GOALS, LATENCY_METRICS, default_jobs
from pagellm.sim.tune_layouts import best_layout_line
from pagellm.workload.command_output import add_output_args, emit_result, print_note, progress_bar

logger = logging.getLogger(__name__)

# Results kept per grid point in the JSON record (the full simulate record is much larger).
_POINT_FIELDS = (
    "num_requests", "completed", "rejected", "requests_per_s", "output_tok_s", "ttft_ms_median", "ttft_ms_p99",
    "itl_ms_median", "itl_ms_p99", "tpot_ms_median", "e2el_ms_p99", "kv_usage_mean",
    "kv_usage_max", "num_preemptions", "num_allocation_failures", "kv_capacity_tokens",
    "num_steps", "tier_hit_blocks", "sim_wall_s",
)  # fmt: skip
# Column headers of knobs whose names are too long for the table.
_SHORT_NAMES = {"tensor_parallel_size": "TP", "data_parallel_size": "DP"}


def add_tune_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "tune",
        help="simulate a grid of engine arguments and recommend the best for a goal",
        description="Sweep max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, "
        "max_model_len, block_size and the prefill/decode balance knobs (each flag takes "
        "several values) over one simulated workload, rank the configurations for a goal, "
        "and print the winner as a command line. --num-gpus compares the ways to deploy "
        "the model on that many GPUs (tensor- x data-parallel layouts). --json prints the "
        "full result as JSON instead of the table, --result-file appends it to a file.",
    )
    add_target_args(p)
    add_parallel_args(p, tune=True)
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
    add_output_args(p)
    p.set_defaults(run_command=run_tune)
    return p  # fmt: skip


def run_tune(args: argparse.Namespace) -> dict[str, Any]:
    from pagellm.sim.runs import target_from_args, workload_from_args
    from pagellm.sim.command_args import engine_args_from
    from pagellm.sim.tune import DEFAULT_GRID, TuneGoal, grid_points, rank, run_grid
    from pagellm.sim.tune_layouts import enumerate_layouts

    jobs = default_jobs() if args.jobs is None else args.jobs
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    goal = TuneGoal(args.goal, args.max_p99_ttft_ms, args.max_p99_itl_ms, args.latency_metric)
    layouts = None
    if args.num_gpus is not None:
        if args.tensor_parallel_size != 1 or args.data_parallel_size != 1:
            raise ConfigError(
                "--num-gpus tries every tensor x data parallel layout itself: leave out "
                "--tensor-parallel-size and --data-parallel-size"
            )
        target = target_from_args(args, 1)
        layouts = enumerate_layouts(args.num_gpus, target.model_config)
    else:
        target = target_from_args(args)
    values: dict[str, tuple[Any, ...]] = {}
    for name in TUNED_KNOBS:
        given = getattr(args, name)
        if given:
            values[name] = tuple(dict.fromkeys(given))  # drop repeats, keep order
        elif name in DEFAULT_GRID and layouts is None:
            # With layouts the question is the layout: knobs stay at their defaults
            # unless given.
            values[name] = DEFAULT_GRID[name]
    if target.gpu is None and "gpu_memory_utilization" in values:
        raise ConfigError(
            "--gpu-memory-utilization has no effect with --calibration (the CPU's KV budget is "
            "fixed; use --kv-cache-memory-bytes)"
        )
    base = engine_args_from(args)
    points = grid_points(values)
    targets: dict[int, Any] = {target.tensor_parallel_size: target}
    if layouts is not None:
        points = [{**layout.knobs, **knobs} for layout in layouts for knobs in points]
        for layout in layouts:
            tp = layout.tensor_parallel_size
            if tp not in targets:
                try:
                    targets[tp] = target_from_args(args, tp)
                except PagellmError as e:  # cannot split, or no TP with a calibration
                    targets[tp] = str(e)
    longest = max(values.get("max_model_len", (base.max_model_len or target.model_config.max_position_embeddings,)))
    workload = workload_from_args(args, longest)
    logger.info("simulating %d configurations of %s on %s (%d jobs)", len(points),
                target.model_name, target.device_name, jobs)  # fmt: skip
    start = time.perf_counter()
    simulate_point = _PointSimulator(targets, target.tensor_parallel_size, args.data_parallel_size,
                                     base, workload.requests, goal)  # fmt: skip
    progress = progress_bar(len(points), "configurations", "config")
    try:
        ranked = rank(run_grid(points, simulate_point, jobs, None if progress is None else progress.update), goal)
    finally:
        if progress is not None:
            progress.close()
    wall = time.perf_counter() - start
    grid = values if layouts is None else {
        "tensor_parallel_size": [layout.tensor_parallel_size for layout in layouts],
        "data_parallel_size": [layout.data_parallel_size for layout in layouts],
        **values,
    }  # fmt: skip
    record = _make_record(target, workload, goal, grid, ranked, wall)
    if layouts is not None:
        record["num_gpus"] = args.num_gpus
        record["layouts"] = [{**layout.knobs, "error": layout.error} for layout in layouts]
        links = [t.tensor_parallel.describe() for t in targets.values()
                 if not isinstance(t, str) and t.tensor_parallel is not None]  # fmt: skip
        record["interconnect"] = {k: v for k, v in links[0].items() if k != "tensor_parallel_size"} if links else None
    emit_result(record, lambda r: print_ranking(r, args.top), args.json, args.result_file)
    if args.plot:
        from pagellm.sim.tune_chart import draw_tune_chart

        print_note(draw_tune_chart(record, args.plot), args.json)
    return record


class _PointSimulator:
    """Simulates one grid point (picklable state, so spawned workers can run it).

    `targets` maps each tensor-parallel size to its target, or to why there is none;
    a point's tensor_parallel_size / data_parallel_size knobs pick the target and the
    number of replicas, the other knobs are engine arguments.
    """

    def __init__(self, targets: dict[int, Any], tensor_parallel_size: int, data_parallel_size: int,
                 base: Any, requests: list[Any], goal: Any) -> None:  # fmt: skip
        self.targets = targets
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size = data_parallel_size
        self.base = base
        self.requests = requests
        self.goal = goal

    def __call__(self, knobs: dict[str, Any]) -> Any:
        from pagellm.sim.runs import engine_description, simulate
        from pagellm.sim.tune import TunePoint, engine_args_for, slo_attainment

        engine_knobs = dict(knobs)
        tp = engine_knobs.pop("tensor_parallel_size", self.tensor_parallel_size)
        dp = engine_knobs.pop("data_parallel_size", self.data_parallel_size)
        target = self.targets[tp]
        if isinstance(target, str):
            return TunePoint(knobs, None, error=target)
        try:
            run = simulate(target, engine_args_for(self.base, engine_knobs), self.requests, dp)
        except PagellmError as e:
            return TunePoint(knobs, None, error=str(e))
        summary = {name: run.summary[name] for name in _POINT_FIELDS}
        summary["slo_attainment"] = slo_attainment(run.result.requests, self.goal)
        return TunePoint(knobs, summary, engine_description(run, target))


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
    headers = ["#", *(_SHORT_NAMES.get(name, name) for name in swept),
               "out tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]  # fmt: skip
    if metric_key not in ("ttft_ms_median", "ttft_ms_p99", "itl_ms_median", "itl_ms_p99"):
        headers.append(f"{metric} ms")
    with_slo = record["goal"]["max_p99_ttft_ms"] is not None or record["goal"]["max_p99_itl_ms"] is not None
    if with_slo:
        headers.append("SLO att.")
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
               _fmt(r["ttft_ms_median"]), _fmt(r["ttft_ms_p99"]), _fmt(r["itl_ms_median"]),
               _fmt(r["itl_ms_p99"])]  # fmt: skip
        if metric_key not in ("ttft_ms_median", "ttft_ms_p99", "itl_ms_median", "itl_ms_p99"):
            row.append(_fmt(r.get(metric_key)))
        if with_slo:
            attained = r.get("slo_attainment")
            row.append("-" if attained is None else f"{attained:.1%}")
        row += [f"{r['kv_usage_mean']:.0%}", str(r["num_preemptions"]),
                "ok" if not point["misses"] else "; ".join(point["misses"])]  # fmt: skip
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    if "num_gpus" in record:
        link = record["interconnect"]
        where = f"{record['num_gpus']} x {record['target']['device']} ({record['cost_model'].get('kind', 'roofline')}"
        if link is not None:
            where += (f"; TP over {link['interconnect']}, {link['interconnect_unidirectional_gbs']:g} GB/s per "
                      f"direction x {link['allreduce_efficiency']:g}, {link['allreduce_latency_us']:g} us "
                      "per all-reduce")  # fmt: skip
        where += ")"
    else:
        where = f"{record['target']['device']} ({record['cost_model']['name']})"
    print(f"{record['target']['model']} on {where}; "
          f"{record['workload']['description']}; goal: {record['goal']['goal']}")  # fmt: skip
    # The status column is left-aligned (its cells are sentences), and so is its header.
    print("  ".join(h.rjust(w) if i < len(headers) - 1 else h for i, (h, w) in enumerate(zip(headers, widths))))
    for row in rows:
        print("  ".join(cell.rjust(w) if i < len(row) - 1 else cell for i, (cell, w) in enumerate(zip(row, widths))))
    if len(record["points"]) > top:
        print(f"... {len(record['points']) - top} more with --json or in --result-file (or raise --top)")
    recommended = record["recommended"]
    if recommended is None:
        print("no valid configuration: every one was refused (see status)")
        return
    if not recommended["meets_goal"]:
        print("no configuration meets every requirement; the closest is:")
    print(f"recommended: {recommended['command']}")
    layout_line = best_layout_line(record)
    if layout_line is not None:
        print(layout_line)
