"""Entrypoints stage: HTTP: the OpenAI-compatible server: routes, app factory and `run_server`.

`build_app` wires the route groups (routes/) to one AsyncLLM; the engine loop starts with the app
(lifespan startup) and stops with it. `run_server` binds the port first (so a busy port
fails before a model is loaded), builds the engine, and serves with uvicorn until SIGINT
or SIGTERM: then it stops accepting, lets in-flight requests finish for
`--shutdown-timeout` seconds, aborts what is left, stops the engine and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pagellm.config.engine_args import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.anthropic.serving import MessagesServing
from pagellm.entrypoints.ollama.serving import OllamaServing
from pagellm.entrypoints.openai import metrics
from pagellm.entrypoints.openai.auth import ApiKeyMiddleware
from pagellm.entrypoints.openai.errors import UnhandledErrorMiddleware, install_error_handlers
from pagellm.entrypoints.openai.openapi_docs import LORA_ADAPTER, ServerBounds, install_openapi
from pagellm.entrypoints.openai.prompt_cache_diagnostics import DiagnosticsService
from pagellm.entrypoints.openai.reasoning import REASONING_FORMATS
from pagellm.entrypoints.openai.request_limits import BodySizeLimitMiddleware
from pagellm.entrypoints.openai.routes import (
    completions,
    dashboard,
    embeddings,
    messages,
    ollama,
    responses,
    sleep,
    status,
    tokens,
)
from pagellm.entrypoints.openai.routes.services import Services
from pagellm.entrypoints.openai.server_config import ServerConfig
from pagellm.entrypoints.openai.serving_batch import (
    BACKGROUND_TOKEN_ENV,
    BackgroundHeaderMiddleware,
    BatchServing,
    add_batch_routes,
    batch_dir_for,
    in_process_call,
)
from pagellm.entrypoints.openai.serving_chat import ChatServing
from pagellm.entrypoints.openai.serving_common import ServingContext
from pagellm.entrypoints.openai.serving_completion import CompletionServing
from pagellm.entrypoints.openai.serving_embedding import EmbeddingServing, embedding_dimensions
from pagellm.entrypoints.openai.serving_lora import AdapterRegistry, add_lora_routes, parse_lora_modules
from pagellm.entrypoints.openai.serving_responses import ResponsesServing
from pagellm.entrypoints.openai.serving_score import ScoreServing
from pagellm.entrypoints.openai.serving_tokens import TokenServing
from pagellm.entrypoints.openai.text_encoding import TextEncodingMiddleware
from pagellm.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)


def build_app(async_llm: AsyncLLM, config: ServerConfig | None = None, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app serving `async_llm` with `config` (default: ServerConfig()); its
    lifespan starts and stops the engine loop. The --lora-modules adapters are read and
    checked here."""
    config = config or ServerConfig()
    engine = async_llm.engine
    name = config.served_model_name or engine.config.source.name
    limits = config.limits
    config.check_engine(enable_lora=engine.config.lora_config is not None)
    adapters = AdapterRegistry(name, engine.config.lora_config, engine.read_adapter, engine.adapter_checked)
    for adapter_name, adapter_path in parse_lora_modules(config.lora_modules):
        try:
            adapters.add(adapter_name, adapter_path)
        except InvalidRequestError as e:
            raise ConfigError(f"--lora-modules {adapter_name}={adapter_path}: {e}") from None
    reasoning = REASONING_FORMATS[config.reasoning_parser] if config.reasoning_parser else None
    context = ServingContext(
        async_llm, name, limits, reasoning, config.structured_outputs_in_reasoning, config.data_parallel_rank, adapters,
        per_request_metrics=config.enable_per_request_metrics,
        diagnostics=DiagnosticsService(
            limits.max_stored_responses, engine.config.cache_config.block_size,
            engine.config.cache_config.enable_prefix_caching, engine.config.cache_budget.kv_offload_path is not None,
        ),
    )  # fmt: skip
    chat = ChatServing(context)
    batches = BatchServing(batch_dir_for(config.batch_dir, name), limits.max_batch_file_bytes)
    services = Services(
        async_llm, name, context, adapters, CompletionServing(context), chat, ResponsesServing(context, chat),
        MessagesServing(context, chat), EmbeddingServing(context), ScoreServing(context), TokenServing(context),
        OllamaServing(context, chat),
        metrics.make_registry(async_llm, name, batches.progress, adapters=adapters.lora_config is not None),
        health_stall_seconds=config.health_stall_seconds,
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        # Batch lines: up to twice the running seats in flight, so the queue never runs dry.
        batches.start(in_process_call(app, config.api_key), 2 * engine.config.scheduler_config.max_num_seqs)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await batches.stop()  # before the engine: in-flight lines run again on restart
            await async_llm.shutdown()

    app = FastAPI(title="pagellm", lifespan=lifespan)
    app.state.services = services
    app.state.batches = batches
    install_error_handlers(app)
    bounds = ServerBounds(
        context.vocab_size,
        context.max_model_len,
        limits,
        max_logprobs=engine.max_logprobs,
        max_num_seqs=engine.config.scheduler_config.max_num_seqs,
        api_key=bool(config.api_key),
        embedding_dimensions=embedding_dimensions(engine.model_config),
        empty_text_has_tokens=bool(context.tokenizer.encode("")),
        thinking=reasoning is not None,
        max_sleep_level=1 if engine.config.lora_config is not None else 2,
    )
    install_openapi(app, bounds)
    # Innermost first: the size limit bounds what the encoding check buffers, and a bug's
    # 500 is answered inside every other layer.
    app.add_middleware(UnhandledErrorMiddleware)
    app.add_middleware(TextEncodingMiddleware)
    app.add_middleware(
        BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes, max_upload_bytes=limits.max_batch_file_bytes
    )
    background_token = os.environ.get(BACKGROUND_TOKEN_ENV)
    if background_token:  # a data-parallel replica: the router's batch lines
        app.add_middleware(BackgroundHeaderMiddleware, token=background_token)
    if config.api_key:  # added last: runs first, so that no body is read for a bad key
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    # In this order: the schema lists the paths as they are added.
    for group in (status, sleep, completions, responses, messages, embeddings, ollama):
        app.include_router(group.router)
    add_batch_routes(app, batches)
    add_lora_routes(app, adapters, LORA_ADAPTER)
    app.include_router(dashboard.router)
    dashboard.add_dashboard_page(app)
    app.include_router(tokens.router)
    return app


# ---------------------------------------------------------------------- running


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # sockets that say they are TCP, and accepted connections inherit the listener's proto.
    # With Nagle on, a response's body waited for the client's delayed ACK of its headers:
    # 40 ms on every request after a connection's first.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _ready_message(async_llm: AsyncLLM, name: str, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    config = async_llm.engine.config
    cache = config.cache_config
    return (
        f"pagellm is ready: model '{name}' at http://{host}:{port}/v1 "
        f"(KV cache: {cache.num_usable_gpu_blocks} blocks of {cache.block_size} tokens = "
        f"{cache.max_num_cached_tokens} tokens; max_model_len={config.scheduler_config.max_model_len})"
    )


def run_server(server_config: ServerConfig, engine_args: EngineArgs) -> None:
    """`pagellm serve`: serve until SIGINT/SIGTERM, then shut down gracefully."""
    sock = bind_socket(server_config.host, server_config.port)
    async_llm = AsyncLLM.from_engine_args(
        engine_args, server_config.max_num_queued_requests, server_config.sleep_idle_seconds, server_config.sleep_idle_level
    )
    name = server_config.served_model_name or async_llm.engine.config.source.name
    app = build_app(
        async_llm, server_config, on_ready=lambda: logger.info("%s", _ready_message(async_llm, name, sock))
    )
    config = uvicorn.Config(
        app,
        log_config=None,  # keep the process' logging setup
        access_log=False,
        lifespan="on",
        # A backstop: in-flight requests are aborted (and so end) after shutdown_timeout.
        timeout_graceful_shutdown=server_config.shutdown_timeout + 10,
    )
    server = uvicorn.Server(config)
    keep_signals_from_killing()
    # What the start built (the vocabulary, the checkpoint's metadata, modules: some hundreds
    # of thousands of objects) lives as long as this process; frozen, the collector's full
    # passes no longer walk it during steps (2.6% -> 1.4% of a 36-request decode run's CPU
    # time in perf on SmolLM2). Only here, where one engine lives until exit: in a process
    # that makes and drops engines (LLM in a notebook, a test worker) frozen objects that
    # later become unreachable cycles are never collected (a test worker grew to 10 GB).
    gc.collect()
    gc.freeze()
    engine_died = asyncio.run(_serve(server, async_llm, sock, server_config.shutdown_timeout, app.state.batches))
    if engine_died:
        # Non-zero, so that an orchestrator (systemd, Kubernetes) restarts the server.
        logger.error("pagellm server stopped: the engine died")
        raise SystemExit(1)
    logger.info("pagellm server stopped")


async def _serve(
    server: uvicorn.Server, async_llm: AsyncLLM, sock: socket.socket, grace_s: float, batches: BatchServing
) -> bool:
    """Serve until shut down; True if it stopped because the engine died."""
    watcher = asyncio.create_task(_abort_after_grace(server, async_llm, grace_s, batches))
    death_watch = asyncio.create_task(_exit_when_engine_dies(server, async_llm))
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        death_watch.cancel()
    return death_watch.done() and not death_watch.cancelled() and death_watch.result()


# How long a dead engine's server keeps answering (503 on /health, errors on requests)
# before it exits: long enough for a health check to see why.
ENGINE_DEATH_GRACE_S = 2.0


async def _exit_when_engine_dies(server: uvicorn.Server, async_llm: AsyncLLM) -> bool:
    while not server.should_exit:
        if server.started and async_llm.dead_error is not None:
            logger.error("the engine died (%s): the server exits", async_llm.dead_error)
            await asyncio.sleep(ENGINE_DEATH_GRACE_S)
            server.should_exit = True
            return True
        await asyncio.sleep(0.1)
    return False


async def _abort_after_grace(server: uvicorn.Server, async_llm: AsyncLLM, grace_s: float, batches: BatchServing) -> None:
    while not server.should_exit:
        await asyncio.sleep(0.1)
    # Batch lines in flight are not waited for: a restart runs them again.
    await batches.stop()
    logger.info("shutting down: in-flight requests get %.0f s to finish", grace_s)
    await asyncio.sleep(grace_s)
    async_llm.abort_all()


def keep_signals_from_killing() -> None:
    """Make SIGINT/SIGTERM harmless outside uvicorn's own handling.

    uvicorn handles both while it serves, then re-raises the signal once it has shut
    down; with these handlers in place that re-raise is a no-op, so a graceful shutdown
    exits 0 instead of dying by the signal.
    """

    def note(signum: int, _: FrameType | None) -> None:
        logger.debug("signal %d after shutdown: ignored", signum)

    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, note)
