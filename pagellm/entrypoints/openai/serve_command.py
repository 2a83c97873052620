"""Entrypoints stage: CLI: `pagellm serve`, its flags, and the hand-off to the HTTP server.

Only argparse is imported here, so that `pagellm --help` and the other commands never pay
for importing FastAPI, uvicorn or the model stack.
"""

from __future__ import annotations

import argparse

from pagellm.config.cli_args import add_engine_args, engine_args_from_namespace
from pagellm.entrypoints.openai.limits_config import add_limit_args
from pagellm.entrypoints.openai.server_config import ServerConfig, add_server_args


def add_serve_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize).",
    )
    add_server_args(serve)
    add_limit_args(serve)
    add_engine_args(serve)
    serve.set_defaults(run_command=run_serve)
    return serve


def run_serve(args: argparse.Namespace) -> None:
    config = ServerConfig.from_namespace(args)  # every server setting checked here, once
    engine_args = engine_args_from_namespace(args)
    config.check_engine(engine_args.enable_lora)
    if config.data_parallel_size > 1:
        from pagellm.entrypoints.openai.data_parallel.server import run_dp_server

        run_dp_server(config, engine_args)
        return
    from pagellm.entrypoints.openai.api_server import run_server

    run_server(config, engine_args)
