"""Every refused request gets its status and an OpenAI-shaped error body; none gets a 500."""

from __future__ import annotations

import threading

import httpx2
import openai
import pytest
from serve_helpers import MAX_MODEL_LEN, greedy_offline


def post(server, path: str, body=None, content: bytes | None = None, headers=None):  # noqa: ANN001, ANN201
    all_headers = {**server.headers(), **(headers or {})}
    if content is not None:
        all_headers.setdefault("Content-Type", "application/json")
        return httpx2.post(server.base_url + path, content=content, headers=all_headers, timeout=60)
    return httpx2.post(server.base_url + path, json=body, headers=all_headers, timeout=60)


def assert_error(response, status: int, param: str | None = None, *fragments: str) -> dict:  # noqa: ANN001
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def completion(**fields):  # noqa: ANN003, ANN201
    return {"prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields):  # noqa: ANN003, ANN201
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


# ------------------------------------------------------------------------ 401 / 404


def test_api_key_is_required_on_the_api(server, model_name):
    url = server.api_url + "/completions"
    missing = httpx2.post(url, json=completion(), timeout=30)
    assert_error(missing, 401)
    wrong = httpx2.post(url, json=completion(), headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert_error(httpx2.get(server.api_url + "/models", timeout=30), 401)
    with openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0) as bad_client:
        with pytest.raises(openai.AuthenticationError):
            bad_client.models.list()
    # Probes and scrapers need no key.
    assert httpx2.get(server.base_url + "/health", timeout=30).status_code == 200
    assert httpx2.get(server.base_url + "/metrics", timeout=30).status_code == 200


def test_unknown_model_is_404(server):
    for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
        error = assert_error(post(server, path, {**body, "model": "gpt-7"}), 404, "model", "gpt-7")
        assert error["code"] == "model_not_found"
    assert_error(httpx2.get(server.base_url + "/v1/nowhere", headers=server.headers()), 404)


def test_a_wrong_method_is_405_with_allow(server):
    response = httpx2.get(server.api_url + "/completions", headers=server.headers(), timeout=30)
    assert_error(response, 405)
    assert response.headers["allow"] == "POST"
    response = httpx2.delete(server.api_url + "/models", headers=server.headers(), timeout=30)
    assert_error(response, 405)
    assert response.headers["allow"] == "GET"


def test_openai_client_sees_typed_errors(client, model_name):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-7", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="hi", max_tokens=2, temperature=-1)
    assert err.value.body["param"] == "temperature"


# ----------------------------------------------------------------------------- 400


def test_prompt_longer_than_max_model_len(server):
    too_long = "a" * (MAX_MODEL_LEN + 10)  # one token per byte
    assert_error(
        post(server, "/v1/completions", completion(prompt=too_long)),
        400, "prompt", str(MAX_MODEL_LEN + 10), str(MAX_MODEL_LEN),
    )
    messages = [{"role": "user", "content": too_long}]
    assert_error(post(server, "/v1/chat/completions", chat(messages=messages)), 400, "prompt")


def test_max_tokens_past_the_context(server):
    error = assert_error(
        post(server, "/v1/completions", completion(max_tokens=MAX_MODEL_LEN)),
        400, "max_tokens", str(MAX_MODEL_LEN),
    )
    assert "5" in error["message"]  # the prompt's 5 tokens
    # The field the client sent is the one named.
    assert_error(post(server, "/v1/chat/completions", chat(max_completion_tokens=10**9)), 400, "max_completion_tokens")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -7),
        ("min_p", 2.0),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("seed", 2**70),
        ("logprobs", 1000),
        ("stop_token_ids", [100000]),
        ("logit_bias", {"not-a-token": 1}),
        ("logit_bias", {"5": 1000}),
        ("n", 10**6),
    ],
)
def test_invalid_sampling_parameter_names_its_param(server, field, value):
    assert_error(post(server, "/v1/completions", completion(**{field: value})), 400, field)


def test_invalid_chat_parameters(server):
    assert_error(post(server, "/v1/chat/completions", chat(top_logprobs=3)), 400, "top_logprobs")
    assert_error(post(server, "/v1/chat/completions", chat(top_logprobs=99, logprobs=True)), 400, "top_logprobs")
    assert_error(post(server, "/v1/chat/completions", chat(temperature=-1)), 400, "temperature")


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], [[1, 2], []]])
def test_empty_prompts(server, prompt):
    assert_error(post(server, "/v1/completions", completion(prompt=prompt)), 400, "prompt")


@pytest.mark.parametrize("prompt", [[1, 999], [-1], [[5], [256]], [2**64]])
def test_out_of_vocabulary_token_ids(server, prompt):
    assert_error(post(server, "/v1/completions", completion(prompt=prompt)), 400, "prompt")


def test_malformed_json_and_wrong_types(server):
    assert_error(post(server, "/v1/completions", content=b'{"prompt": "hi",'), 400, None, "JSON")
    assert_error(post(server, "/v1/completions", content=b"NaN"), 400)
    assert_error(post(server, "/v1/completions", content=b""), 400)
    assert_error(post(server, "/v1/completions", content=b"[1, 2]"), 400)
    assert_error(post(server, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    assert_error(post(server, "/v1/completions", completion(prompt=5)), 400, "prompt")
    assert_error(post(server, "/v1/completions", completion(prompt=[1.5])), 400, "prompt")
    assert_error(post(server, "/v1/completions", completion(max_tokens="x")), 400, "max_tokens")
    assert_error(post(server, "/v1/completions", completion(temperature="hot")), 400, "temperature")
    assert_error(post(server, "/v1/completions", completion(stream=[1])), 400, "stream")
    assert_error(post(server, "/v1/completions", content=b'{"prompt":"hi","temperature":NaN}'), 400, "temperature")
    assert_error(post(server, "/v1/completions", content=b'{"prompt":"hi","top_p":Infinity}'), 400, "top_p")
    assert_error(post(server, "/v1/chat/completions", chat(messages="hi")), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", chat(messages=[])), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", chat(messages=[{"content": "x"}])), 400, "messages")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(server, "/v1/chat/completions", chat(messages=image)), 400, "messages")
    assert_error(post(server, "/tokenize", {"prompt": 3}), 400, "prompt")
    assert_error(post(server, "/detokenize", {"tokens": [1, 4096]}), 400, "tokens")


def test_unsupported_fields_are_refused_not_ignored(server):
    assert_error(post(server, "/v1/completions", completion(suffix="x")), 400, "suffix")
    assert_error(post(server, "/v1/completions", completion(best_of=3)), 400, "best_of")


def test_a_bad_request_fails_alone(server, model_name, offline_llm):
    """Refusals while a stream runs leave it untouched."""
    max_tokens = 1500
    expected = greedy_offline(offline_llm, "steady", max_tokens, ignore_eos=True).outputs[0].text
    streamed: list[str] = []
    started = threading.Event()

    def run_stream() -> None:
        with openai.OpenAI(base_url=server.api_url, api_key=server.api_key, max_retries=0) as c:
            for chunk in c.completions.create(
                model=model_name, prompt="steady", max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            ):
                streamed.append(chunk.choices[0].text)
                started.set()

    thread = threading.Thread(target=run_stream)
    thread.start()
    assert started.wait(120)
    for bad in (completion(prompt=[999]), completion(temperature=-1), completion(model="x")):
        assert post(server, "/v1/completions", bad).status_code in (400, 404)
    thread.join(120)
    assert "".join(streamed) == expected


def test_tokenize_and_detokenize(server, model_name):
    tokens = post(server, "/tokenize", {"prompt": "hi!", "model": model_name}).json()
    assert tokens == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": list(b"hi!")}
    chat_tokens = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert bytes(chat_tokens["tokens"]) == b"<user>hi\n<assistant>"
    assert post(server, "/detokenize", {"tokens": list(b"hi!")}).json() == {"prompt": "hi!"}


def test_the_openapi_schema_documents_each_status_with_the_error_body(server):
    spec = httpx2.get(server.base_url + "/openapi.json", timeout=30).json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        operation = spec["paths"][path]["post"]
        assert "requestBody" in operation
        responses = operation["responses"]
        assert sorted(responses) == ["200", "400", "401", "404", "413", "500", "503"]
        for status in ("400", "401", "404", "413", "500", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == error_ref
    # The server answers invalid bodies with 400 in OpenAI's shape, not FastAPI's 422.
    assert not any("422" in op["responses"] for ops in spec["paths"].values() for op in ops.values())
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_the_openapi_schema_carries_this_servers_bounds(server):
    """Ranges every server shares come from the request models; the vocabulary,
    max_model_len and the request limits are this server's own."""
    from pagellm.entrypoints.openai.limits_config import RequestLimits

    spec = httpx2.get(server.base_url + "/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    limits = RequestLimits()

    def non_null(prop: dict) -> list[dict]:
        return [form for form in prop.get("anyOf", [prop]) if form.get("type") != "null"]

    assert props["n"]["minimum"] == 1 and props["n"]["maximum"] == limits.max_n
    assert non_null(props["top_p"]) == [{"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}]
    assert non_null(props["temperature"])[0]["minimum"] == 0
    assert non_null(props["max_tokens"])[0]["maximum"] == MAX_MODEL_LEN
    assert non_null(props["logprobs"])[0]["maximum"] == 20  # the engine's --max-logprobs
    token_lists = [form for form in non_null(props["prompt"]) if form["type"] == "array" and form["items"].get("type") == "integer"]
    assert token_lists[0]["items"]["maximum"] == 255  # the tiny model's vocabulary is 256
    bias = non_null(props["logit_bias"])[0]
    assert bias["maxProperties"] == limits.max_logit_bias_entries
    assert bias["propertyNames"]["pattern"] == token_id_key_pattern(255)
    assert non_null(props["suffix"]) == []  # only null
    roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert set(roles) == {"system", "developer", "user", "assistant", "tool"}
    assert spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}
    assert "text/event-stream" in spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert "security" not in spec["paths"]["/health"]["get"]
    assert spec["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]


def token_id_key_pattern(max_id: int) -> str:
    from pagellm.entrypoints.openai.openapi_docs import token_id_key_pattern as pattern

    return pattern(max_id)


@pytest.mark.parametrize("max_id", [0, 5, 9, 10, 99, 100, 150, 255, 1000, 31999, 151935])
def test_the_token_id_key_pattern_matches_exactly_the_ids_below_the_vocabulary(max_id: int):
    import re

    pattern = re.compile(token_id_key_pattern(max_id))
    matched = [i for i in range(2 * max_id + 20) if pattern.match(str(i))]
    assert matched == list(range(max_id + 1))
    for key in ("01", "-1", " 1", "1 ", "+1", "1.0", ""):
        assert not pattern.match(key)


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("stream", "true", "stream"),  # strict: a string is not a boolean
        ("n", "2", "n"),  # nor a number
        ("n", 1.5, "n"),
        ("temperature", True, "temperature"),
        ("top_p", 0, "top_p"),
        ("stop", "", "stop"),
        ("logit_bias", {"01": 1}, "logit_bias"),
        ("logit_bias", {"5": 101}, "logit_bias"),
        ("seed", 2**53, "seed"),
        ("suffix", "tail", "suffix"),
        ("guided_choice", [], "guided_choice"),
    ],
)
def test_the_request_models_refuse_what_the_schema_refuses(server, field, value, param):
    assert_error(post(server, "/v1/completions", completion(**{field: value})), 400, param)


def test_integral_floats_are_integers_as_in_json_schema(server):
    response = post(server, "/v1/completions", completion(n=2.0, max_tokens=3.0, prompt=[5.0, 6]))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


def test_chat_messages_need_a_known_role_and_content_or_tool_calls(server):
    assert_error(post(server, "/v1/chat/completions", chat(messages=[{"role": "", "content": "x"}])), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", chat(messages=[{"role": "user"}])), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])), 400, "messages")


def test_tokenize_takes_a_prompt_or_messages_not_both(server):
    assert post(server, "/tokenize", {"prompt": "hi"}).status_code == 200
    assert post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert post(server, "/tokenize", {"prompt": "hi", "messages": None, "unknown": 1}).status_code == 200
    for body in ({}, {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}):
        assert_error(post(server, "/tokenize", body), 400, None, "exactly one of 'prompt' and 'messages'")


# ------------------------------------------------------------------------ text that is not Unicode

LONE = "ab\ud800cd"  # what a JavaScript client sends when it cuts a string inside an emoji


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": LONE, "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2}, "messages"),
        ("/v1/messages", {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2}, "messages"),
        ("/tokenize", {"prompt": LONE}, "prompt"),
        ("/v1/embeddings", {"input": [LONE]}, "input"),
        ("/v1/responses", {"input": LONE, "max_output_tokens": 2}, "input"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": LONE}, "user"),  # never tokenized
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["x", "\udc00"]}, "stop"),
    ],
)
def test_a_lone_surrogate_is_a_400_and_the_connection_stays_usable(server, model_name, path, body, param):
    import http.client
    import json

    host, port = server.base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {**server.headers(), "Content-Type": "application/json"}
    try:
        # json.dumps escapes the surrogate as \ud800, as a JavaScript client's JSON.stringify does.
        connection.request("POST", path, body=json.dumps({"model": model_name, **body}), headers=headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 400, answer
        if path == "/v1/messages":
            assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
            message = answer["error"]["message"]
        else:
            assert answer["error"]["param"] == param, answer
            message = answer["error"]["message"]
        assert "lone UTF-16 surrogate (U+D" in message and "at character" in message, message
        # The same keep-alive connection serves the next request.
        connection.request("POST", "/tokenize", body=json.dumps({"model": model_name, "prompt": "hi"}), headers=headers)
        again = connection.getresponse()
        assert again.status == 200 and json.loads(again.read())["count"] == 2
    finally:
        connection.close()


def test_surrogate_pairs_and_escaped_backslashes_are_valid_text(server, model_name):
    # An emoji escaped as a pair, and the six characters \ud800 written with an escaped backslash.
    content = b'{"model": "%s", "prompt": "\\ud83d\\ude00 \\\\ud800"}' % model_name.encode()
    tokens = post(server, "/tokenize", content=content)
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == list("😀 \\ud800".encode())  # the tiny model's tokens are bytes
