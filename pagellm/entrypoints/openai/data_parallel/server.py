"""Entrypoints stage: HTTP: `pagellm serve --data-parallel-size M`: M engine replicas behind one
OpenAI-compatible endpoint.

The router tokenizes each prompt (the replicas' own tokenizer and chat template) and
picks a replica by prefix-cache affinity, then load (router.py); the request
is passed through unchanged, its answer (streamed or not) passed back byte for byte, so
every replica keeps its own validation, errors and streaming. A replica that dies is
noticed within a second: the router stops sending to it, a request whose replica could
not be reached is retried on another, and the survivors keep serving; with none left,
/health answers 503 and the server exits with status 1. A stored response (the Responses
API) lives in the replica that made it, whose rank its id carries: requests naming it go
there. The router runs the Files and Batch API itself: its batch lines go through its own
routes to the replicas, marked as background work by a token the replicas were given.

/metrics holds the router's own figures (decisions by reason, requests in flight, live
replicas) and every replica's engine metrics with a `replica` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx2 as httpx
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pagellm.config.engine_args import EngineArgs
from pagellm.config.cli_args import engine_args_to_cli
from pagellm.entrypoints.openai.api_key import API_KEY_ENV
from pagellm.entrypoints.openai.api_server import bind_socket, keep_signals_from_killing
from pagellm.entrypoints.openai.auth import ApiKeyMiddleware
from pagellm.entrypoints.openai.server_config import ServerConfig
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.routes import completions, embeddings, messages, ollama, responses, sleep, status, tokens
from pagellm.entrypoints.openai.routes.dashboard import add_dashboard_page
from pagellm.entrypoints.openai.data_parallel.replicas import Replica, start_process_replicas, start_ray_replicas
from pagellm.entrypoints.openai.data_parallel.router import PrefixAffinityRouter
from pagellm.entrypoints.openai.metrics import BatchCollector
from pagellm.entrypoints.openai.serving_batch import (
    BACKGROUND_HEADER,
    BACKGROUND_TOKEN_ENV,
    BatchServing,
    add_batch_routes,
    batch_dir_for,
    in_process_call,
)
from pagellm.model.checkpoint import load_model_config, load_tokenizer, resolve_model_source
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# One INFO line per forwarded request would drown the log.
logging.getLogger("httpx2").setLevel(logging.WARNING)

HEALTH_INTERVAL_S = 0.2  # how often replica processes are checked
LOAD_INTERVAL_S = 1.0  # how often replicas' KV usage is read
ENGINE_DEATH_GRACE_S = 2.0
_FORWARDED_HEADERS = ("authorization", "content-type", "accept", BACKGROUND_HEADER)


# A response id a replica of rank N makes: resp_rN_<hex> (serving_responses.py).
_TAGGED_RESPONSE_ID = re.compile(r"resp_r(\d+)_[0-9a-f]+")


# The body field whose text a request is routed by (its prefix-cache affinity), by the
# path's last part; "prompt" for the others.
_PROMPT_FIELDS = {"embeddings": "input", "responses": "input", "score": "text_1", "rerank": "query"}


class ReplicaRouter:
    """The replicas, the routing state, and the router's own metrics."""

    def __init__(
        self, replicas: Sequence[Replica], tokenizer: Tokenizer, block_size: int, routing: str = "affinity"
    ) -> None:
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self.policy = PrefixAffinityRouter(len(replicas), block_size=block_size, use_affinity=routing == "affinity")
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "pagellm:router_requests", "Requests routed, by replica and reason (affinity, load, balance, retry, pinned).",
            ["replica", "reason"], registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "pagellm:router_in_flight", "Requests sent to a replica and not yet answered.", ["replica"],
            registry=self.registry,
        )  # fmt: skip
        self.alive_gauge = Gauge("pagellm:router_replicas_alive", "Replicas serving.", registry=self.registry)
        self.alive_gauge.set(len(replicas))
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    # ----------------------------------------------------------------- routing

    async def routing_tokens(self, path: str, body: Any) -> list[int]:
        """The prompt's token ids as the replica will see them ([] when they cannot be
        known here: the request then goes by load, and its replica judges it)."""
        try:
            if path.endswith("/chat/completions"):
                messages = body.get("messages")
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                return await asyncio.to_thread(self.tokenizer.encode, text, False)
            prompt = body.get(_PROMPT_FIELDS.get(path.rsplit("/", 1)[-1], "prompt"))
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: route by its first prompt
            if isinstance(prompt, str):
                return await asyncio.to_thread(self.tokenizer.encode, prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception:  # noqa: BLE001 - a malformed request is the replica's to refuse
            logger.debug("no routing tokens for this request", exc_info=True)
        return []

    def holder_of(self, response_id: str, param: str | None = None) -> int:
        """The replica that stored a response (its id names it: resp_r<rank>_...)."""
        match = _TAGGED_RESPONSE_ID.fullmatch(response_id)
        index = int(match.group(1)) if match else -1
        if not 0 <= index < len(self.replicas):
            what = "Previous response" if param == "previous_response_id" else "Response"
            raise APIError(404, f"{what} with id '{response_id}' not found.", param=param,
                           code="previous_response_not_found" if param else "not_found")  # fmt: skip
        if not self.policy.loads[index].alive:
            raise APIError(503, f"Engine replica {index}, which holds response '{response_id}', is down.", code="engine_dead")
        return index

    def live(self) -> list[int]:
        return [i for i, load in enumerate(self.policy.loads) if load.alive]

    def mark_dead(self, index: int) -> None:
        if self.policy.loads[index].alive:
            self.policy.mark_dead(index)
            self.alive_gauge.set(self.policy.num_alive)
            logger.error(
                "data-parallel replica %d is down: %d of %d replicas serve",
                index, self.policy.num_alive, len(self.replicas),
            )  # fmt: skip

    # -------------------------------------------------------------- forwarding

    async def forward(self, request: Request, path: str, pinned: int | None = None) -> Response:
        """Send the request to a replica chosen for it (or to `pinned`, the one holding the
        stored response it names); a replica that cannot be reached is marked down and the
        next choice tried."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if pinned is None and path == "/v1/responses" and isinstance(body, dict):
            previous = body.get("previous_response_id")
            pinned = self.holder_of(previous, "previous_response_id") if isinstance(previous, str) else None
        routable = self.policy.use_affinity and isinstance(body, dict) and request.method == "POST"
        tokens = await self.routing_tokens(path, body) if routable and pinned is None else []
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        retry = False
        while True:
            if pinned is not None:
                index = pinned
                self.decisions.labels(str(index), "pinned").inc()
            else:
                try:
                    decision = self.policy.choose(tokens)
                except LookupError:
                    raise APIError(503, "No engine replica is serving.", code="engine_dead") from None
                index = decision.replica
                self.decisions.labels(str(index), "retry" if retry else decision.reason).inc()
            replica = self.replicas[index]
            outgoing = self.client.build_request(
                request.method, replica.url + path, content=raw, headers=headers, params=request.query_params
            )
            self._started(index)
            try:
                upstream = await self.client.send(outgoing, stream=True)
            except httpx.TransportError as e:
                self._finished(index)
                if not replica.is_alive():
                    self.mark_dead(index)
                    if pinned is not None:
                        raise APIError(503, f"Engine replica {index}, which holds that response, is down.", code="engine_dead") from None
                    retry = True
                    continue
                raise APIError(503, f"Engine replica {index} cannot be reached: {e}", code="replica_unreachable") from None
            return StreamingResponse(
                self._relay(upstream, index),
                status_code=upstream.status_code,
                headers={k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "cache-control", "retry-after")},
            )

    async def _relay(self, upstream: httpx.Response, index: int) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            # The replica died mid-answer: a streamed answer ends with an error event.
            logger.warning("replica %d broke off an answer: %s", index, e)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                error = APIError(503, f"Engine replica {index} stopped while answering.", code="engine_dead")
                yield f"data: {json.dumps(error.body().model_dump(mode='json'))}\n\n".encode()
        finally:
            await upstream.aclose()
            self._finished(index)

    def _started(self, index: int) -> None:
        self.policy.started(index)
        self.in_flight.labels(str(index)).set(self.policy.loads[index].in_flight)

    def _finished(self, index: int) -> None:
        self.policy.finished(index)
        self.in_flight.labels(str(index)).set(self.policy.loads[index].in_flight)

    # ----------------------------------------------------------------- watching

    async def watch(self) -> None:
        """Mark replicas down as their processes end; read their KV usage now and then."""
        ticks = 0
        while True:
            for index in self.live():
                if not await asyncio.to_thread(self.replicas[index].is_alive):
                    self.mark_dead(index)
            if ticks % round(LOAD_INTERVAL_S / HEALTH_INTERVAL_S) == 0:
                await asyncio.gather(*(self._read_load(i) for i in self.live()))
            ticks += 1
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _read_load(self, index: int) -> None:
        text = await self._replica_metrics(index)
        for line in (text or "").splitlines():
            if line.startswith("pagellm:kv_cache_usage_perc"):
                self.policy.report_kv_usage(index, float(line.rsplit(" ", 1)[1]))

    async def _replica_metrics(self, index: int) -> str | None:
        try:
            response = await self.client.get(self.replicas[index].url + "/metrics", timeout=5.0)
            return response.text if response.status_code == 200 else None
        except httpx.TransportError:
            return None

    async def broadcast(self, request: Request, path: str) -> Response:
        """The request sent to every live replica (sleep and wake-up: the whole endpoint
        sleeps); the first failure's answer, else each replica's answer by index."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        live = self.live()

        async def send(index: int) -> httpx.Response:
            url = self.replicas[index].url + path
            return await self.client.request(request.method, url, headers=headers, params=request.query_params)

        try:
            answers = await asyncio.gather(*(send(index) for index in live))
        except httpx.TransportError as e:
            raise APIError(503, f"An engine replica cannot be reached: {e}", code="replica_unreachable") from None
        for answer in answers:
            if answer.status_code != 200:
                return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        replicas = {str(index): answer.json() for index, answer in zip(live, answers, strict=True)}
        sleeping = all(answer.get("is_sleeping") for answer in replicas.values())
        return JSONResponse({"is_sleeping": sleeping, "replicas": replicas})

    async def metrics_text(self) -> bytes:
        """The router's metrics, then every live replica's with a `replica` label."""
        texts = await asyncio.gather(*(self._replica_metrics(i) for i in self.live()))
        merged: dict[str, Metric] = {}
        for index, text in zip(self.live(), texts, strict=False):
            if text is None:
                continue
            for family in text_string_to_metric_families(text):
                target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    target.add_sample(sample.name, {**sample.labels, "replica": str(index)}, sample.value)
        registry = CollectorRegistry()
        registry.register(_Fixed(list(merged.values())))
        return generate_latest(self.registry) + generate_latest(registry)

    async def close(self) -> None:
        await self.client.aclose()


class _Fixed:
    """A collector that yields metric families read from elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def build_router_app(
    router: ReplicaRouter,
    name: str,
    api_key: str | None,
    batches: BatchServing | None = None,
    background_token: str = "",
    max_batch_lines_in_flight: int = 64,
) -> FastAPI:
    """The router's endpoint. With `batches` it runs the Files and Batch API itself: batch
    lines go through its own routes to the replicas, marked with `background_token`."""
    batches = batches or BatchServing(None, 1)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        marker = {BACKGROUND_HEADER: background_token} if background_token else {}
        batches.start(in_process_call(app, api_key, marker), max_batch_lines_in_flight)
        try:
            yield
        finally:
            await batches.stop()

    app = FastAPI(title="pagellm (data parallel)", lifespan=lifespan)
    router.registry.register(BatchCollector(batches.progress, name))
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(request.url.path)

    @app.get("/health")
    async def health() -> Response:
        alive = router.policy.num_alive
        if alive == 0:
            return APIError(503, "No engine replica is serving.", code="engine_dead").response()
        return JSONResponse({"status": "ok", "replicas_alive": alive, "replicas": len(router.replicas)})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(await router.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The replicas' own route groups, each route forwarded as it is declared there (path,
    # methods, schema entry): a route added to a group is routed here with no change.
    for group in (completions, embeddings, messages, tokens, responses, ollama):
        forward_routes(app, group.router, router)
    # /v1/models (and one by name) is the replicas' (with their adapters); /health and /metrics are the router's.
    forward_routes(app, status.router, router, only={"/v1/models", "/v1/models/{model:path}"})
    add_batch_routes(app, batches)
    # Sleep and wake-up: every replica at once.
    for route in sleep.router.routes:
        if isinstance(route, APIRoute):
            app.add_api_route(
                route.path, _broadcast_endpoint(router, route.path),
                methods=sorted(route.methods), name=route.name, responses=route.responses,
                operation_id=route.operation_id,
            )  # fmt: skip

    @app.get("/v1/engine/state")
    async def engine_state(request: Request, replica: int = 0) -> Response:
        """The dashboard's view of one replica (?replica=N; default the first)."""
        if not 0 <= replica < len(router.replicas) or not router.policy.loads[replica].alive:
            raise APIError(404, f"replica {replica} is not serving (live: {router.live()})", param="replica")
        response = await router.client.get(router.replicas[replica].url + "/v1/engine/state", timeout=10.0)
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    add_dashboard_page(app)  # the same page; its state comes from a replica (above)
    return app


def _broadcast_endpoint(router: ReplicaRouter, path: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await router.broadcast(request, path)

    return endpoint


def forward_routes(app: FastAPI, group: APIRouter, router: ReplicaRouter, only: set[str] | None = None) -> None:
    """Add each route of `group` (or those whose path is in `only`) to `app`, forwarded to
    a replica. A route that names a stored response goes to the replica that holds it: its
    id says which."""

    async def endpoint(request: Request) -> Response:
        return await router.forward(request, request.url.path)

    async def stored_response_endpoint(response_id: str, request: Request) -> Response:
        return await router.forward(request, request.url.path, router.holder_of(response_id))

    for route in group.routes:
        if isinstance(route, APIRoute) and (only is None or route.path in only):
            app.add_api_route(
                route.path,
                stored_response_endpoint if "{response_id}" in route.path else endpoint,
                methods=sorted(route.methods),
                name=route.name,
                responses=route.responses,
                include_in_schema=route.include_in_schema,
                operation_id=route.operation_id,
            )


def run_dp_server(config: ServerConfig, engine_args: EngineArgs) -> None:
    """Start the replicas, then route to them until SIGINT/SIGTERM (or until none is left)."""
    sock = bind_socket(config.host, config.port)
    source = resolve_model_source(engine_args.model)
    tokenizer = load_tokenizer(source, load_model_config(source))
    name = config.served_model_name or source.name
    serve_args = replica_serve_args(config, engine_args, name)
    # The replicas require the API key too; the router passes clients' headers on. They
    # take the requests of the router's batch runner as background work by a token.
    background_token = secrets.token_hex(16)
    env = {BACKGROUND_TOKEN_ENV: background_token, **({API_KEY_ENV: config.api_key} if config.api_key else {})}
    size = config.data_parallel_size
    if engine_args.distributed_executor_backend == "ray":
        gpus = engine_args.tensor_parallel_size if engine_args.device != "cpu" and _has_cuda() else 0
        replicas: list[Replica] = list(start_ray_replicas(size, serve_args, gpus, env))
    else:
        replicas = list(start_process_replicas(size, serve_args, os.cpu_count() or 1, env))
    router = ReplicaRouter(replicas, tokenizer, engine_args.block_size, config.data_parallel_routing)
    # The router runs the Files and Batch API itself (the replicas run with it off).
    batches = BatchServing(batch_dir_for(config.batch_dir, name), config.limits.max_batch_file_bytes)
    app = build_router_app(router, name, config.api_key, batches, background_token, 2 * engine_args.max_num_seqs * size)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    keep_signals_from_killing()
    try:
        all_died = asyncio.run(_serve(server, router, sock, name))
    finally:
        for replica in replicas:
            replica.stop(config.shutdown_timeout + 10)
    if all_died:
        logger.error("pagellm server stopped: every engine replica died")
        raise SystemExit(1)
    logger.info("pagellm server stopped")


def replica_serve_args(config: ServerConfig, engine_args: EngineArgs, name: str) -> list[str]:
    """A replica's `pagellm serve` flags (its port, and its --data-parallel-rank, are the
    replica launcher's)."""
    return config.replica(name).to_cli() + engine_args_to_cli(engine_args)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def _serve(server: uvicorn.Server, router: ReplicaRouter, sock: Any, name: str) -> bool:
    """Serve; True if it stopped because every replica died."""
    watcher = asyncio.create_task(router.watch())
    death_watch = asyncio.create_task(_exit_when_all_died(server, router))
    host, port = sock.getsockname()[:2]
    logger.info(
        "pagellm is ready: model '%s' at http://%s:%d/v1 (data parallel: %d replicas at %s)",
        name, host, port, len(router.replicas), ", ".join(r.url for r in router.replicas),
    )  # fmt: skip
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        death_watch.cancel()
        with contextlib.suppress(Exception):
            await router.close()
    return death_watch.done() and not death_watch.cancelled() and death_watch.result()


async def _exit_when_all_died(server: uvicorn.Server, router: ReplicaRouter) -> bool:
    while not server.should_exit:
        if router.policy.num_alive == 0:
            logger.error("every engine replica died: the server exits")
            await asyncio.sleep(ENGINE_DEATH_GRACE_S)
            server.should_exit = True
            return True
        await asyncio.sleep(0.1)
    return False
