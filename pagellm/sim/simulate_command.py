"""Sim stage: `pagellm simulate`, one engine configuration against a workload.

Prints a readable table (or, with --json, the full record as one JSON document) and
appends the record as a JSON line to --result-file.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pagellm.sim.command_args import (
    add_parallel_args,
    add_sim_engine_args,
    add_sim_speculation_args,
    add_sim_workload_args,
    add_target_args,
)
from pagellm.workload.command_output import add_output_args, emit_result

logger = logging.getLogger(__name__)


def add_simulate_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "simulate",
        help="run the real scheduler on a simulated clock: throughput, latency, KV use",
        description="Serve a workload with pagellm's own scheduler and KV cache manager, "
        "a step cost model (roofline on a GPU preset, or calibrated on a measured machine) "
        "standing in for the model. Prints a table; --json prints the full result as JSON "
        "instead, --result-file appends it to a file.",
    )
    add_target_args(p)
    add_parallel_args(p)
    add_sim_workload_args(p)
    add_sim_engine_args(p)
    add_sim_speculation_args(p)
    add_output_args(p)
    p.set_defaults(run_command=run_simulate)
    return p


def run_simulate(args: argparse.Namespace) -> dict[str, Any]:
    from pagellm.sim.runs import make_record, simulate, target_from_args, workload_from_args
    from pagellm.sim.command_args import engine_args_from, speculation_from
    from pagellm.sim.report import print_sim_table
    from pagellm.sim.target import resolve_engine_config

    target = target_from_args(args)
    engine_args = engine_args_from(args)
    speculation = speculation_from(args)
    engine_config = resolve_engine_config(target, engine_args)  # refuse bad configs before the workload
    workload = workload_from_args(args, engine_config.scheduler_config.max_model_len)
    run = simulate(target, engine_args, workload.requests, args.data_parallel_size, speculation)
    record = make_record(target, workload, run)
    emit_result(record, print_sim_table, args.json, args.result_file)
    return record
