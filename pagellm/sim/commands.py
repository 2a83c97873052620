"""Sim stage: the `pagellm simulate`, `tune` and `calibrate` subcommands' parsers
(each sets `run_command`, which pagellm/entrypoints/cli.py calls)."""

from pagellm.sim.calibrate_command import add_calibrate_parser
from pagellm.sim.simulate_command import add_simulate_parser
from pagellm.sim.tune_command import add_tune_parser

__all__ = ["add_calibrate_parser", "add_simulate_parser", "add_tune_parser"]
