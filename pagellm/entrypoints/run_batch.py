"""Entrypoints stage: CLI: `pagellm run-batch INPUT OUTPUT`: a batch file run offline.

The input is the Batch API's JSONL (one `{"custom_id", "method", "url", "body"}` per line;
each line may call /v1/chat/completions, /v1/completions or /v1/embeddings). Every line goes
through the server's own route, called in-process on an app that listens on no port, so an
offline result is what the server would answer; the output holds one result per line, in
input order, in the Batch API's format (a failed line carries its error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from pagellm.config.cli_args import add_engine_args
from pagellm.errors import PagellmError

logger = logging.getLogger(__name__)


def add_run_batch_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "run-batch",
        help="run a Batch API input file (JSONL) offline",
        description="Run every line of a Batch API input file (JSONL) through the model and write "
        "one result per line, in input order, in the Batch API's output format.",
    )
    parser.add_argument("input", help="the input JSONL file")
    parser.add_argument("output", help="where to write the results (JSONL)")
    parser.add_argument("--served-model-name", default=None, help="the model name the lines' bodies use")
    add_engine_args(parser)
    parser.set_defaults(run_command=run_batch_command)
    return parser


def run_batch_command(args: argparse.Namespace) -> None:
    from pagellm.config.cli_args import engine_args_from_namespace
    from pagellm.engine.async_llm import AsyncLLM

    source = Path(args.input)
    if not source.is_file():
        raise PagellmError(f"no input file {source}")
    async_llm = AsyncLLM.from_engine_args(engine_args_from_namespace(args))
    name = args.served_model_name or async_llm.engine.config.source.name
    counts = asyncio.run(run_batch_file(async_llm, name, source, Path(args.output)))
    print(f"{counts['completed']} lines completed, {counts['failed']} failed: {args.output}")


async def run_batch_file(async_llm: Any, name: str, source: Path, target: Path) -> dict[str, int]:
    """Run every line of `source`; write the results to `target`. Returns the counts."""
    from pagellm.entrypoints.openai.api_server import build_app
    from pagellm.entrypoints.openai.server_config import ServerConfig
    from pagellm.entrypoints.openai.batch_runner import LineError, parse_line
    from pagellm.entrypoints.openai.batch_store import jsonl_lines, new_id
    from pagellm.entrypoints.openai.protocol_batch import result_line
    from pagellm.entrypoints.openai.serving_batch import in_process_call

    app = build_app(async_llm, ServerConfig(served_model_name=name, batch_dir="none"))
    call = in_process_call(app, None)
    lines = list(jsonl_lines(source))
    results: dict[int, dict[str, Any]] = {}
    seats = asyncio.Semaphore(2 * async_llm.engine.config.scheduler_config.max_num_seqs)

    async def run(number: int, text: str) -> None:
        async with seats:
            try:
                custom_id, body = parse_line(text, None)
            except LineError as e:
                error = {"code": e.code, "message": str(e)}
                results[number] = result_line(new_id("batch_req"), e.custom_id, None, None, error)
                return
            url = json.loads(text)["url"]
            status, response = await call(url, body)
            request_id = response.get("id") if isinstance(response, dict) and status == 200 else None
            results[number] = result_line(request_id or new_id("batch_req"), custom_id, status, response, None)

    async with app.router.lifespan_context(app):
        await asyncio.gather(*(run(number, text) for number, text in lines))
    with open(target, "w", encoding="utf-8") as f:
        for number, _ in lines:
            f.write(json.dumps(results[number], ensure_ascii=False) + "\n")
    completed = sum(1 for r in results.values() if r["response"] is not None and r["response"]["status_code"] == 200)
    return {"completed": completed, "failed": len(results) - completed}
