"""The app in-process: a fuzz of request bodies finds no 500, and a dead engine is reported.

A small context (128 tokens) keeps every generation the fuzz asks for short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from pagellm import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.server_config import ServerConfig

ENGINE = {"max_model_len": 128, "num_gpu_blocks_override": 128}
ALLOWED = {200, 400, 404}


@pytest.fixture(scope="module")
def app_client(tiny_model: str, single_torch_thread: None) -> Iterator[TestClient]:
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model, **ENGINE))
    app = build_app(async_llm, ServerConfig(served_model_name="tiny"))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    assert not async_llm.is_alive  # the lifespan stopped the engine loop


# ---------------------------------------------------------------------------- fuzz

# Any JSON value at all: what a confused or hostile client may put in any field.
wild = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=40),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-2, max_value=300), max_size=6),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-200, 200), max_size=3),
)
# Plausible values, so that most bodies get through validation to the engine.
token_ids = st.lists(st.integers(min_value=0, max_value=255), min_size=1, max_size=12)
prompts = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
    token_ids,
    st.lists(token_ids, min_size=1, max_size=3),
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
    ),
    min_size=1,
    max_size=3,
)
sampling = {
    "model": st.just("tiny"),
    "n": st.integers(min_value=1, max_value=3),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.05, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=20),
    "min_p": st.floats(min_value=0, max_value=0.5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(min_value=-(2**53 - 1), max_value=2**53 - 1),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=255), max_size=3),
    "logit_bias": st.dictionaries(
        st.integers(min_value=0, max_value=255).map(str), st.floats(-100, 100), max_size=3
    ),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(min_value=0, max_value=8),
    "priority": st.integers(min_value=-5, max_value=5),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "user": st.text(max_size=8),
}
valid_completions = st.fixed_dictionaries(
    {"prompt": prompts, "max_tokens": st.integers(min_value=1, max_value=24)},
    optional={
        **sampling,
        "echo": st.booleans(),
        "logprobs": st.integers(min_value=0, max_value=5),
    },
)
valid_chats = st.fixed_dictionaries(
    # max_tokens is always there: chat's default is "the rest of the context".
    {"messages": messages, "max_tokens": st.integers(min_value=1, max_value=24)},
    optional={
        **sampling,
        "max_completion_tokens": st.integers(min_value=1, max_value=24),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(min_value=0, max_value=5),
    },
)


def with_one_wild_field(bodies: st.SearchStrategy[dict], keys: list[str]) -> st.SearchStrategy[dict]:
    """A plausible body with one field (maybe a new one) set to any JSON value."""
    return st.tuples(bodies, st.sampled_from(keys), wild).map(
        lambda t: {**t[0], t[1]: t[2]}
    )


_COMMON_KEYS = [*sampling, "max_tokens", "logprobs", "unknown_field"]
completion_bodies = st.one_of(
    valid_completions,
    with_one_wild_field(valid_completions, ["prompt", "echo", "best_of", "suffix", *_COMMON_KEYS]),
)
chat_bodies = st.one_of(
    valid_chats,
    with_one_wild_field(
        valid_chats, ["messages", "max_completion_tokens", "top_logprobs", *_COMMON_KEYS]
    ),
)


def check(response) -> None:  # noqa: ANN001
    assert response.status_code in ALLOWED, (response.status_code, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events[:-1]), events
    else:
        assert response.json()["choices"]


FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions_never_500(app_client, body):
    check(app_client.post("/v1/completions", json=body))


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_never_500(app_client, body):
    check(app_client.post("/v1/chat/completions", json=body))


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    raw=st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode)),
)
def test_fuzz_raw_bytes_never_500(app_client, path, raw):
    response = app_client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code in (400, 404), response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_engine_is_empty_after_the_fuzz(app_client):
    metrics = app_client.get("/metrics").text
    assert 'pagellm:num_unfinished_requests{model_name="tiny"} 0.0' in metrics
    assert app_client.get("/health").json() == {"status": "ok"}


# ----------------------------------------------------------------------- dead engine


def test_a_dead_engine_is_reported_and_never_hangs(tiny_model, single_torch_thread):
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model, **ENGINE))

    def broken_step():  # noqa: ANN202
        raise RuntimeError("device lost")

    async_llm.engine.step = broken_step
    app = build_app(async_llm, ServerConfig(served_model_name="tiny"))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200
        body = {"prompt": "hi", "max_tokens": 4}
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 503
        assert failed.json()["error"]["code"] == "engine_dead"
        health = client.get("/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]
        later = client.post("/v1/completions", json={**body, "stream": True})
        assert later.status_code == 503
        streamed = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
        )
        assert streamed.status_code == 503
        assert 'pagellm:engine_alive{model_name="tiny"} 0.0' in client.get("/metrics").text


def test_a_stream_reports_an_engine_death_in_band(tiny_model, single_torch_thread):
    """Once a stream has started (status 200 sent), a dying engine ends it with an error
    event and [DONE], not a hang."""
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model, **ENGINE))
    real_step = async_llm.engine.step
    num_steps = 0

    def step_then_die():  # noqa: ANN202
        nonlocal num_steps
        num_steps += 1
        if num_steps > 3:
            raise RuntimeError("device lost")
        return real_step()

    async_llm.engine.step = step_then_die
    app = build_app(async_llm, ServerConfig(served_model_name="tiny"))
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == "engine_dead"


# ------------------------------------------------------------------ operation ids


def test_every_operation_has_its_own_id(app_client: TestClient):
    """Generated clients name a method after its operation id: two operations sharing one
    (a route serving GET and DELETE) would collide. FastAPI warns of a duplicate."""
    import warnings

    app_client.app.openapi_schema = None  # generated again here, warnings seen
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "Duplicate Operation ID" warning fails the test
        schema = app_client.get("/openapi.json").json()
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) > 20
    by_id = {"response_by_id_v1_responses__response_id__get", "response_by_id_v1_responses__response_id__delete",
             "file_by_id_v1_files__file_id__get", "file_by_id_v1_files__file_id__delete"}  # fmt: skip
    assert by_id <= set(ids)
    # Still one route per path serving both: a 405 names both methods.
    response = app_client.post("/v1/responses/resp_x")
    assert response.status_code == 405 and set(response.headers["allow"].split(", ")) == {"GET", "DELETE"}


def test_the_router_schema_has_unique_ids_too():
    import warnings

    from prometheus_client import CollectorRegistry

    from pagellm.entrypoints.openai.data_parallel.server import build_router_app

    class NoReplicas:  # build_router_app reads only its metrics registry before serving
        registry = CollectorRegistry()

    app = build_router_app(NoReplicas(), "m", None)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = app.openapi()
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))
    assert set(schema["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}


def test_the_router_serves_every_route_a_replica_serves(app_client: TestClient):
    """The data-parallel router takes its forwarded routes from the server's route groups:
    every path and method a replica serves (bar its adapter admin, which differs per
    replica) is served by the router under the same operation."""
    from fastapi.routing import APIRoute
    from prometheus_client import CollectorRegistry

    from pagellm.entrypoints.openai.data_parallel.server import build_router_app

    class NoReplicas:
        registry = CollectorRegistry()

    def flat(routes):  # noqa: ANN001, ANN202 - an included router is one entry in app.routes
        for route in routes:
            included = getattr(route, "original_router", None)
            yield from flat(included.routes) if included is not None else [route]

    def served(app) -> dict[tuple[str, str], str]:  # noqa: ANN001
        return {(r.path, m): r.name for r in flat(app.routes) if isinstance(r, APIRoute) for m in r.methods}

    replica = served(app_client.app)
    router = served(build_router_app(NoReplicas(), "m", None))  # type: ignore[arg-type]
    missing = {key for key in replica if key not in router and "lora_adapter" not in key[0]}
    assert not missing
    routed_as_replica = {key for key in replica if router.get(key) == replica[key]}
    assert {("/v1/responses/{response_id}", "DELETE"), ("/rerank", "POST"), ("/v1/models", "GET")} <= routed_as_replica
