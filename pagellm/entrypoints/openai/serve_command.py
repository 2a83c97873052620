"""Entrypoints stage: CLI: `pagellm serve`, its flags, and the hand-off to the HTTP server.

Only argparse is imported here, so that `pagellm --help` and the other commands never pay
for importing FastAPI, uvicorn or the model stack.
"""

from __future__ import annotations

import argparse
import json
import os

from pagellm.config.cli_args import add_engine_args
from pagellm.entrypoints.openai.api_key import API_KEY_ENV
from pagellm.entrypoints.openai.limits_config import RequestLimits, add_limit_args
from pagellm.entrypoints.openai.reasoning import REASONING_FORMATS
from pagellm.errors import ConfigError


def add_serve_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize).",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model file or folder name)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on the API (default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="most requests waiting for the batch; more get 503 (default: no limit)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they "
        "are aborted (default: 5)",
    )
    serve.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind this endpoint, each with its own KV cache (and its own "
        "--tensor-parallel-size ranks); requests go by prefix-cache affinity, then load. With "
        "--distributed-executor-backend ray the replicas are placed on the Ray cluster (default: 1)",
    )
    serve.add_argument(
        "--data-parallel-routing",
        choices=("affinity", "load"),
        default="affinity",
        help="how the replicas are chosen: affinity = prefix-cache affinity, then load; "
        "load = the least loaded replica only (default: affinity)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_FORMATS),
        default=None,
        help="split a thinking model's output: the text between its think tags goes to "
        "reasoning_content (chat), reasoning items (Responses) and thinking blocks (Messages) "
        "(default: none, all text is content)",
    )
    serve.add_argument(
        "--structured-outputs-config",
        type=structured_outputs_config,
        default=None,
        metavar="JSON",
        help="""vLLM's option, as a JSON object; this server reads '{"enable_in_reasoning": true}': """
        "with --reasoning-parser, output constraints (response formats, tool calls) hold the "
        "think block too, from the first output token (default: they hold the answer after it)",
    )
    serve.add_argument(
        "--batch-dir",
        default=None,
        metavar="DIR",
        help="where the Files and Batch API keep uploaded files and batches, so that a restart "
        "resumes unfinished batches; 'none' turns the API off (default: "
        "$PAGELLM_CACHE_DIR or ~/.cache/pagellm, then batches/<served model name>)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve from the start (with --enable-lora), each as name=path or "
        "{\"name\": ..., \"path\": ...}; requests select one by its name in `model`",
    )
    # Set by a data-parallel server on its replicas: it tags the ids of stored responses, so
    # that the router sends a follow-up (GET, previous_response_id) to the replica holding it.
    serve.add_argument("--data-parallel-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_limit_args(serve)
    add_engine_args(serve)
    serve.set_defaults(run_command=run_serve)
    return serve


STRUCTURED_OUTPUTS_KEYS = ("enable_in_reasoning",)


def structured_outputs_config(text: str) -> dict[str, bool]:
    """--structured-outputs-config: a JSON object of the keys this server reads."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_in_reasoning\": true}'")
    unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown key(s) {', '.join(unknown)}; this server reads: {', '.join(STRUCTURED_OUTPUTS_KEYS)}"
        )
    if not isinstance(config.get("enable_in_reasoning", False), bool):
        raise argparse.ArgumentTypeError("enable_in_reasoning must be true or false")
    return config


def run_serve(args: argparse.Namespace) -> None:
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.max_num_queued_requests is not None and args.max_num_queued_requests < 1:
        raise ConfigError(
            f"--max-num-queued-requests must be at least 1, got {args.max_num_queued_requests}"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    RequestLimits.from_namespace(args)  # a bad limit fails here, named
    if args.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.lora_modules and not args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    if args.data_parallel_size > 1:
        if args.enable_lora:  # the router would load an adapter on one replica only
            raise ConfigError("--enable-lora with --data-parallel-size > 1 is not supported yet")
        from pagellm.entrypoints.openai.data_parallel.server import run_dp_server

        run_dp_server(args)
        return
    from pagellm.entrypoints.openai.api_server import run_server

    run_server(args)
