"""Entrypoints stage: the `pagellm` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pagellm.bench.serve import add_bench_serve_parser
from pagellm.bench.throughput_args import add_bench_throughput_parser
from pagellm.bench.kernels import add_bench_kernels_parser
from pagellm.bench.knob_sweep import add_bench_knobs_parser
from pagellm.config.cli_args import add_engine_args
from pagellm.entrypoints.openai.serve_command import add_serve_parser
from pagellm.entrypoints.run_batch import add_run_batch_parser
from pagellm.errors import PagellmError
from pagellm.sim.commands import add_calibrate_parser, add_simulate_parser, add_tune_parser
from pagellm.version import package_version

logger = logging.getLogger("pagellm")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagellm",
        description="LLM inference with continuous batching over a paged KV cache.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"pagellm {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")
    add_engine_args(gen)
    gen.set_defaults(run_command=run_generate_command)

    add_serve_parser(commands)
    add_run_batch_parser(commands)

    report = commands.add_parser("report", help="render a metrics series (JSONL) as PNG charts")
    report.add_argument("series", help="file written with --metrics-series-file")
    report.add_argument("--out", default="pagellm-report", help="folder for the PNG files")
    report.set_defaults(run_command=run_report)

    replay = commands.add_parser("kv-replay", help="rebuild the KV block map from an event log")
    replay.add_argument("events", help="file written with --kv-events-file")
    replay.add_argument("--step", type=int, default=None, help="stop after this step")
    replay.set_defaults(run_command=run_kv_replay)

    bench = commands.add_parser("bench", help="benchmarks: offline throughput, online serving load")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(bench_commands)
    add_bench_throughput_parser(bench_commands)
    add_bench_knobs_parser(bench_commands)
    add_bench_kernels_parser(bench_commands)
    add_simulate_parser(commands)
    add_tune_parser(commands)
    add_calibrate_parser(commands)
    return parser


# Every command's parser names its function (set_defaults(run_command=...)); the heavy
# modules are imported inside them, so that `pagellm --help` imports no torch.


def run_generate_command(args: argparse.Namespace) -> None:
    from pagellm.entrypoints.generate_command import run_generate

    run_generate(args)


def run_report(args: argparse.Namespace) -> None:
    from pagellm.metrics.report import read_series, render_report

    for path in render_report(read_series(args.series), args.out):
        print(path)


def run_kv_replay(args: argparse.Namespace) -> None:
    import json

    from pagellm.core.kv_replay import read_events, replay

    try:
        events = read_events(args.events)
    except (OSError, ValueError) as e:
        raise PagellmError(f"cannot read the KV event log {args.events}: {e}") from None
    state = replay(events, until_step=args.step)
    summary = {
        "step": state.step,
        "blocks_in_use": len(state.device),
        "shared_blocks": sum(1 for holders in state.device.values() if len(holders) > 1),
        "cached_blocks": len(state.cached),
        "host_blocks_in_use": len(state.host),
        "requests": sorted({r for holders in state.device.values() for r in holders}),
    }
    print(json.dumps({"summary": summary, "block_map": state.normalized()}))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        args.run_command(args)
        return 0
    except PagellmError as e:
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagellm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
