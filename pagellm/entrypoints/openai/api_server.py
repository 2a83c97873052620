"""Entrypoints stage: HTTP: the OpenAI-compatible server: routes, app factory and `run_server`.

`build_app` wires the endpoints to one AsyncLLM; the engine loop starts with the app
(lifespan startup) and stops with it. `run_server` binds the port first (so a busy port
fails before a model is loaded), builds the engine, and serves with uvicorn until SIGINT
or SIGTERM: then it stops accepting, lets in-flight requests finish for
`--shutdown-timeout` seconds, aborts what is left, stops the engine and returns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from pagellm.engine.async_llm import AsyncLLM
from pagellm.config.cli_args import engine_args_from_namespace
from pagellm.entrypoints.openai import metrics
from pagellm.entrypoints.openai.auth import ApiKeyMiddleware
from pagellm.entrypoints.openai.openapi_docs import (
    CHAT,
    COMPLETION,
    COUNT_TOKENS,
    EMBEDDING,
    HEALTH,
    MESSAGES,
    RESPONSE_BY_ID,
    RESPONSES,
    METRICS,
    LORA_ADAPTER,
    READ,
    RERANK,
    SCORE,
    TOKENS,
    ServerBounds,
    install_openapi,
)
from pagellm.entrypoints.openai.limits_config import RequestLimits
from pagellm.entrypoints.openai.request_limits import BodySizeLimitMiddleware
from pagellm.entrypoints.openai.errors import install_error_handlers, to_api_error
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.serving_chat import ChatServing
from pagellm.entrypoints.openai.serving_common import ServingContext
from pagellm.entrypoints.openai.serving_completion import CompletionServing
from pagellm.entrypoints.openai.serving_embedding import EmbeddingServing, embedding_dimensions
from pagellm.entrypoints.openai.protocol_score import RerankRequest, ScoreRequest
from pagellm.entrypoints.openai.serving_score import ScoreServing
from pagellm.entrypoints.openai.serving_responses import ResponsesServing
from pagellm.entrypoints.openai.reasoning import REASONING_FORMATS
from pagellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.entrypoints.anthropic.serving import MessagesServing
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.serving_batch import (
    BACKGROUND_TOKEN_ENV,
    BackgroundHeaderMiddleware,
    BatchServing,
    add_batch_routes,
    batch_dir_for,
    in_process_call,
)
from pagellm.entrypoints.openai.serving_lora import AdapterRegistry, add_lora_routes, parse_lora_modules
from pagellm.entrypoints.openai.serving_tokens import TokenServing
from pagellm.entrypoints.dashboard import STATIC_DIR
from pagellm.errors import ConfigError, InvalidRequestError
from pagellm.metrics.dashboard_state import dashboard_state

logger = logging.getLogger(__name__)


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str | None = None,
    api_key: str | None = None,
    on_ready: Callable[[], None] | None = None,
    limits: RequestLimits | None = None,
    reasoning_parser: str | None = None,
    structured_outputs_in_reasoning: bool = False,
    batch_dir: str | Path | None = None,
    data_parallel_rank: int | None = None,
    lora_modules: list[str] | None = None,
) -> FastAPI:
    """The FastAPI app serving `async_llm`; its lifespan starts and stops the engine loop.
    lora_modules: --lora-modules entries (name=path), read and checked here."""
    name = served_model_name or async_llm.engine.config.source.name
    limits = limits or RequestLimits()
    reasoning = REASONING_FORMATS[reasoning_parser] if reasoning_parser else None
    engine = async_llm.engine
    adapters = AdapterRegistry(name, engine.config.lora_config, engine.read_adapter, engine.adapter_checked)
    for adapter_name, adapter_path in parse_lora_modules(lora_modules or []):
        if adapters.lora_config is None:
            raise ConfigError("--lora-modules needs --enable-lora")
        try:
            adapters.add(adapter_name, adapter_path)
        except InvalidRequestError as e:
            raise ConfigError(f"--lora-modules {adapter_name}={adapter_path}: {e}") from None
    context = ServingContext(
        async_llm, name, limits, reasoning, structured_outputs_in_reasoning, data_parallel_rank, adapters
    )
    completions = CompletionServing(context)
    chat = ChatServing(context)
    tokens = TokenServing(context)
    embeddings = EmbeddingServing(context)
    scores = ScoreServing(context)
    responses = ResponsesServing(context, chat)
    messages = MessagesServing(context, chat)
    batches = BatchServing(batch_dir_for(batch_dir, name), limits.max_batch_file_bytes)
    registry = metrics.make_registry(async_llm, name, batches, adapters=adapters.lora_config is not None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        # Batch lines: up to twice the running seats in flight, so the queue never runs dry.
        batches.start(in_process_call(app, api_key), 2 * async_llm.engine.config.scheduler_config.max_num_seqs)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await batches.stop()  # before the engine: in-flight lines run again on restart
            await async_llm.shutdown()

    app = FastAPI(title="pagellm", lifespan=lifespan)
    app.state.batches = batches
    install_error_handlers(app)
    bounds = ServerBounds(
        context.vocab_size,
        context.max_model_len,
        limits,
        max_logprobs=engine.max_logprobs,
        max_num_seqs=engine.config.scheduler_config.max_num_seqs,
        api_key=bool(api_key),
        embedding_dimensions=embedding_dimensions(engine.model_config),
        empty_text_has_tokens=bool(context.tokenizer.encode("")),
    )
    install_openapi(app, bounds)
    app.add_middleware(
        BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes, max_upload_bytes=limits.max_batch_file_bytes
    )
    background_token = os.environ.get(BACKGROUND_TOKEN_ENV)
    if background_token:  # a data-parallel replica: the router's batch lines
        app.add_middleware(BackgroundHeaderMiddleware, token=background_token)
    if api_key:  # added last: runs first, so that no body is read for a bad key
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health", responses=HEALTH)
    async def health() -> Response:
        error = async_llm.dead_error
        if error is not None:
            return to_api_error(error).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS)
    async def get_metrics() -> Response:
        body, content_type = metrics.render(registry)
        return Response(body, media_type=content_type)

    @app.get("/v1/models", responses=READ)
    async def list_models() -> ModelList:
        # No file path in `root`: clients need not learn the server's file layout.
        cards = [ModelCard(id=name, root=name, max_model_len=context.max_model_len)]
        cards += [
            ModelCard(id=adapter, root=adapter, parent=name, max_model_len=context.max_model_len)
            for adapter in adapters.names()
        ]
        return ModelList(data=cards)

    @app.post("/v1/completions", responses=COMPLETION)
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions", responses=CHAT)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post("/v1/responses", responses=RESPONSES)
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await responses.create(body, raw)

    # One route for both methods, so that a 405 on the path names both in `Allow`.
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], responses=RESPONSE_BY_ID)
    async def response_by_id(response_id: str, raw: Request) -> Response:
        return responses.delete(response_id) if raw.method == "DELETE" else responses.retrieve(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=RESPONSE_BY_ID)
    async def cancel_response(response_id: str) -> Response:
        return await responses.cancel(response_id)

    @app.post("/v1/messages", responses=MESSAGES)
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        return await messages.create(body, raw)

    @app.post("/v1/messages/count_tokens", responses=COUNT_TOKENS)
    async def count_message_tokens(body: CountTokensRequest) -> Response:
        return messages.count_tokens(body)

    @app.post("/v1/embeddings", responses=EMBEDDING)
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create(body, raw)

    @app.post("/v1/score", responses=SCORE)
    async def create_score(body: ScoreRequest, raw: Request) -> Response:
        return await scores.score(body, raw)

    @app.post("/v1/rerank", responses=RERANK)
    async def create_rerank(body: RerankRequest, raw: Request) -> Response:
        return await scores.rerank(body, raw)

    # The other paths clients use for the same (vLLM serves them all), left out of the schema.
    app.add_api_route("/score", create_score, methods=["POST"], include_in_schema=False)
    for path in ("/rerank", "/v2/rerank"):
        app.add_api_route(path, create_rerank, methods=["POST"], include_in_schema=False)

    add_batch_routes(app, batches)
    add_lora_routes(app, adapters, LORA_ADAPTER)

    @app.get("/v1/engine/state", responses=HEALTH)
    async def engine_state() -> Response:
        """The block map, queues and time series the dashboard draws."""
        error = async_llm.dead_error
        if error is not None:
            return to_api_error(error).response()
        state = await async_llm.query(dashboard_state)
        state["model"] = name
        return JSONResponse(state)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_redirect() -> Response:
        return RedirectResponse("/dashboard/")

    app.mount("/dashboard", StaticFiles(directory=STATIC_DIR, html=True), name="dashboard")

    @app.post("/tokenize", responses=TOKENS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return tokens.tokenize(body)

    @app.post("/detokenize", responses=TOKENS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return tokens.detokenize(body)

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


def run_server(args: argparse.Namespace) -> None:
    """`pagellm serve`: serve until SIGINT/SIGTERM, then shut down gracefully."""
    sock = bind_socket(args.host, args.port)
    async_llm = AsyncLLM.from_engine_args(
        engine_args_from_namespace(args), args.max_num_queued_requests
    )
    name = args.served_model_name or async_llm.engine.config.source.name
    structured = getattr(args, "structured_outputs_config", None) or {}
    app = build_app(
        async_llm,
        name,
        args.api_key,
        on_ready=lambda: logger.info("%s", _ready_message(async_llm, name, sock)),
        limits=RequestLimits.from_namespace(args),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        structured_outputs_in_reasoning=bool(structured.get("enable_in_reasoning")),
        batch_dir=getattr(args, "batch_dir", None),
        data_parallel_rank=getattr(args, "data_parallel_rank", None),
        lora_modules=getattr(args, "lora_modules", None),
    )
    config = uvicorn.Config(
        app,
        log_config=None,  # keep the process' logging setup
        access_log=False,
        lifespan="on",
        # A backstop: in-flight requests are aborted (and so end) after shutdown_timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + 10,
    )
    server = uvicorn.Server(config)
    keep_signals_from_killing()
    engine_died = asyncio.run(_serve(server, async_llm, sock, args.shutdown_timeout, app.state.batches))
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
