"""Simulation stage: `pagellm simulate`, one engine configuration against a workload.

Prints one JSON line and a readable table, and appends the JSON line to --result-file.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from pagellm.errors import PagellmError
from pagellm.sim.sim_args import (
    add_parallel_args,
    add_sim_engine_args,
    add_sim_speculation_args,
    add_sim_workload_args,
    add_target_args,
)

logger = logging.getLogger(__name__)


def add_simulate_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "simulate",
        help="run the real scheduler on a simulated clock: throughput, latency, KV use",
        description="Serve a workload with pagellm's own scheduler and KV cache manager, "
        "a step cost model (roofline on a GPU preset, or calibrated on a measured machine) "
        "standing in for the model. Prints a JSON line and a table.",
    )
    add_target_args(p)
    add_parallel_args(p)
    add_sim_workload_args(p)
    add_sim_engine_args(p)
    add_sim_speculation_args(p)
    p.add_argument("--result-file", default="", help="append the JSON line here")
    p.set_defaults(run_command=run_simulate)
    return p


def append_json_line(path: str, record: dict[str, Any]) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise PagellmError(f"cannot write the result file {path}: {e.strerror}") from None


def run_simulate(args: argparse.Namespace) -> dict[str, Any]:
    from pagellm.sim.runs import make_record, simulate, target_from_args, workload_from_args
    from pagellm.sim.sim_args import engine_args_from, speculation_from
    from pagellm.sim.sim_report import print_sim_table
    from pagellm.sim.sim_target import resolve_engine_config

    target = target_from_args(args)
    engine_args = engine_args_from(args)
    speculation = speculation_from(args)
    engine_config = resolve_engine_config(target, engine_args)  # refuse bad configs before the workload
    workload = workload_from_args(args, engine_config.scheduler_config.max_model_len)
    run = simulate(target, engine_args, workload.requests, args.data_parallel_size, speculation)
    record = make_record(target, workload, run)
    print(json.dumps(record))
    print_sim_table(record)
    if args.result_file:
        append_json_line(args.result_file, record)
    return record
