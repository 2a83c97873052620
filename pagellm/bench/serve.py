"""Bench stage: `pagellm bench serve`, an online load generator for OpenAI-compatible servers.

Sends a synthetic workload (pagellm/workload/synthetic.py) to one server as streaming
requests, at Poisson or gamma-distributed arrival times and/or a fixed concurrency, and
reports throughput, TTFT / TPOT / ITL / end-to-end latency and goodput under SLOs
(definitions in serve_metrics.py; the load itself in serve_load.py). The run is bounded:
exactly --num-requests requests, each with a total timeout; a failed request is counted
with its error, never raised. Prints a table (or, with --json, the full result as one JSON
document), appends the result as a JSON line to --result-file, and optionally writes PNG
charts (serve_report.py). While it runs, a bar of requests done / total goes to stderr
when that is a terminal.

Exit status: 0 when at least one request completed; 1 when every request failed (the
results are still printed and written first).

Only argparse, the workload and the load generator's plain code are imported at module
level, so that building the CLI parser stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import replace
from typing import Any

from pagellm.bench.serve_load import (
    API_KEY_ENV,
    ENDPOINTS,
    PROMPT_FORMATS,
    ServeBenchConfig,
    ServeBenchRun,
    detokenize_prompts,
    fetch_model_name,
    normalize_base_url,
    run_requests,
)
from pagellm.bench.serve_metrics import parse_goodput_slos, summarize
from pagellm.errors import ConfigError, PagellmError
from pagellm.workload.command_output import add_output_args, emit_result, print_note
from pagellm.workload.synthetic import (
    BenchRequest,
    WorkloadSpec,
    add_workload_args,
    make_workload,
    workload_spec_from_args,
)

logger = logging.getLogger(__name__)


def add_bench_serve_parser(bench_commands: Any) -> argparse.ArgumentParser:
    p = bench_commands.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)",
        description="Send a synthetic workload to an OpenAI-compatible server as streaming "
        "requests and report throughput and latency. Prints a table; --json prints the full "
        "result as JSON instead; the result is also appended to --result-file. Exits 1 if "
        "every request failed.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first in /v1/models)")
    p.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV})")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (default: inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more even")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take in total before it counts as failed")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="ids",
                   help="ids: prompts as token-id lists (exact lengths); text: ids turned into "
                   "text by the server's /detokenize (chat always uses text)")
    p.add_argument("--extra-body", default=None,
                   help='JSON object merged into every request, e.g. \'{"temperature": 0}\'')
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:SECONDS",
                   help="SLOs for goodput, e.g. ttft:0.5 tpot:0.05 e2el:10")
    p.add_argument("--plot-dir", default=None, help="write PNG charts here (needs matplotlib)")
    add_workload_args(p)  # the same workload flags as `bench throughput`, --seed included
    p.add_argument("--max-model-len", type=int, default=None,
                   help="clip prompt + output lengths to fit this context")
    p.add_argument("--token-id-range", type=int, nargs=2, default=(100, 30000),
                   metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI) (keep HI within the vocabulary)")
    add_output_args(p, default_result_file="bench-results/serve.jsonl")
    p.set_defaults(run_command=run_bench_serve)
    return p  # fmt: skip


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    extra_body: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except ValueError as e:
            raise ConfigError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra_body, dict):
            raise ConfigError("--extra-body must be a JSON object")
    return ServeBenchConfig(
        base_url=normalize_base_url(args.base_url),
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
        extra_body=extra_body,
    )


def workload_from_args(args: argparse.Namespace) -> tuple[WorkloadSpec, list[BenchRequest]]:
    low, high = args.token_id_range
    if not 0 <= low < high:
        raise ConfigError(f"--token-id-range needs 0 <= LO < HI, got {low} {high}")
    lengths = (("--prompt-len", args.prompt_len), ("--output-len", args.output_len))
    for flag, (shortest, longest) in lengths:
        if not 1 <= shortest <= longest:
            raise ConfigError(f"{flag} needs 1 <= LO <= HI, got {shortest} {longest}")
    spec = dataclasses.replace(workload_spec_from_args(args), vocab_low=low, vocab_high=high)
    return spec, make_workload(spec, max_model_len=args.max_model_len)


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; print the table (or the JSON with --json); append to --result-file."""
    from pagellm.bench.serve_report import matplotlib_missing, print_table, write_plots

    try:
        import httpx2  # noqa: F401 - the HTTP client of the load generator
    except ImportError:
        raise PagellmError("pagellm bench serve needs httpx2: pip install httpx2") from None
    config = config_from_args(args)
    slos = parse_goodput_slos(args.goodput)
    # httpx2 logs every request at INFO: thousands of lines that would bury the results.
    if not getattr(args, "verbose", False):
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    spec, requests = workload_from_args(args)
    if args.plot_dir and matplotlib_missing():
        logger.warning("--plot-dir: %s; the benchmark runs without charts", matplotlib_missing())
    if config.model is None:
        config = replace(config, model=asyncio.run(fetch_model_name(config)))
    prompt_ids = [r.prompt_token_ids for r in requests]
    prompts: list[list[int]] | list[str] = prompt_ids
    prompt_format = "text" if config.endpoint == "chat" else args.prompt_format
    if prompt_format == "text":
        prompts = asyncio.run(detokenize_prompts(config, prompt_ids))
    logger.info(
        "sending %d requests to %s (rate %s req/s, burstiness %g, max concurrency %s)",
        len(requests), config.url, config.request_rate, config.burstiness,
        config.max_concurrency or "unlimited",
    )  # fmt: skip
    run = asyncio.run(
        run_requests(
            config,
            prompts,
            [r.output_len for r in requests],
            [len(ids) for ids in prompt_ids],
            show_progress=sys.stderr.isatty(),
        )
    )
    result = make_result(config, spec, prompt_format, run, slos)
    emit_result(result, print_table, args.json, args.result_file)
    if args.plot_dir:
        missing = matplotlib_missing()
        if missing:
            print_note(f"charts not written: {missing}", args.json)
        else:
            for chart in write_plots(run.records, result, args.plot_dir):
                print_note(f"chart: {chart}", args.json)
    if result["completed"] == 0 and result["num_requests"] > 0:
        first_error = next(iter(result["errors"]), "unknown error")
        raise PagellmError(
            f"all {result['num_requests']} requests failed (first error: {first_error}); "
            f"is an OpenAI-compatible server running at {config.base_url}?"
        )
    return result


def make_result(
    config: ServeBenchConfig,
    spec: WorkloadSpec,
    prompt_format: str,
    run: ServeBenchRun,
    slos: dict[str, float],
) -> dict[str, Any]:
    """The JSON line: configuration, then summarize()'s results."""
    rate = config.request_rate
    return {
        "bench": "serve",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model": config.model,
        "prompt_format": prompt_format,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "workload": {
            "kind": spec.kind, "num_requests": spec.num_requests,
            "prompt_len": list(spec.prompt_len), "output_len": list(spec.output_len),
            "shared_prefix_len": spec.shared_prefix_len if spec.kind == "shared-prefix" else None,
            "seed": spec.seed,
        },
        **summarize(run.records, run.duration_s, slos),
    }  # fmt: skip
