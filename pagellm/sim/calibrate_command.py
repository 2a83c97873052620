"""Sim stage: `pagellm calibrate`, a short sweep on the real engine fitted into a
step cost model for `pagellm simulate --calibration FILE`.

Timing-sensitive: run it on a quiet machine (nothing else busy on its cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from typing import Any

from pagellm.errors import ConfigError

logger = logging.getLogger(__name__)


def add_calibrate_parser(commands: Any) -> argparse.ArgumentParser:
    from pagellm.config.cli_args import add_engine_args
    from pagellm.sim.calibration_sweep import DEFAULT_MAX_CHUNK

    p = commands.add_parser(
        "calibrate",
        help="measure engine steps on this machine and fit a step cost model for simulate",
        description="Run a short sweep of batches (decodes, prefills, mixed) on the real "
        "engine, time every step and fit its cost; the fit is written as JSON for "
        "`pagellm simulate --calibration FILE`. Run it on an otherwise idle machine.",
    )
    p.add_argument("--output", default="pagellm-calibration.json", help="where to write the fit")
    p.add_argument("--quick", action="store_true", help="a few seconds of sweep (a rough fit)")
    p.add_argument("--sweeps", type=int, default=1,
                   help="run the sweep this many times and fit all the steps together (steadier on a noisy machine)")
    p.add_argument("--max-chunk", type=int, default=DEFAULT_MAX_CHUNK,
                   help="longest prompt chunk measured (default %(default)s)")  # fmt: skip
    add_engine_args(p)
    p.set_defaults(run_command=run_calibrate)
    return p


def run_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.config.cli_args import engine_args_from_namespace
    from pagellm.sim.calibration_sweep import calibrate_engine

    if args.max_chunk < 8:
        raise ConfigError(f"--max-chunk must be at least 8, got {args.max_chunk}")
    engine_args = dataclasses.replace(engine_args_from_namespace(args), disable_log_stats=True)
    engine = LLMEngine.from_engine_args(engine_args)

    def on_case(case: Any, steps: list[Any]) -> None:
        logger.info("%-24s %4d steps %8.2f s", case.label, len(steps), sum(s.seconds for s in steps))

    model, measured = calibrate_engine(engine, quick=args.quick, max_chunk=args.max_chunk, sweeps=args.sweeps,
                                       seed=engine_args.seed, on_case=on_case)  # fmt: skip
    model.save(args.output)
    record = {"bench": "calibrate", "output": args.output, **model.to_json()}
    print(json.dumps(record))
    quality = model.fit.quality
    print(f"{model.name}: {quality.num_steps} steps measured in "
          f"{model.metadata['sweep_seconds']} s")  # fmt: skip
    fit = model.fit
    print("  tokens in step:    " + " ".join(f"{k:>7}" for k in fit.token_knots))
    print("  base ms:           " + " ".join(f"{v * 1e3:7.2f}" for v in fit.base_s))
    print("  decodes in step:   " + " ".join(f"{k:>7}" for k in fit.decode_knots))
    print("  per decode KV us:  " + " ".join(f"{v * 1e6:7.3f}" for v in fit.decode_context_s))
    print(f"  per prefill pair {fit.prefill_pair_s * 1e9:.3f} ns, per sampled row "
          f"{fit.sampled_row_s * 1e3:.3f} ms, per prefill chunk {fit.prefill_chunk_s * 1e3:.3f} ms")  # fmt: skip
    print(f"  fit: R^2 {quality.r2:.4f}, relative error median {quality.median_abs_rel_error:.1%}, "
          f"mean {quality.mean_abs_rel_error:.1%}, p90 {quality.p90_abs_rel_error:.1%}; "
          f"total time {quality.total_time_rel_error:+.1%}")  # fmt: skip
    print(f"written to {args.output}")
    return record
