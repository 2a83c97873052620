"""The body check that refuses a lone surrogate, and the 500 answered inside the app."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagellm.entrypoints.openai.errors import APIError, UnhandledErrorMiddleware
from pagellm.entrypoints.openai.text_encoding import TextEncodingMiddleware, check_json_body


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (json.dumps({"prompt": "a\ud800"}).encode(), "prompt"),
        (json.dumps({"messages": [{"content": [{"text": "\udc00x"}]}]}).encode(), "messages[0].content[0].text"),
        (json.dumps({"metadata": {"k\ud83d": "v"}}).encode(), "metadata.k"),  # a key
        (b'{"prompt": "a\xed\xa0\x80"}', "prompt"),  # raw bytes of a surrogate: the decoder passes them
        (b'{"prompt": "\\uDBFF"}', "prompt"),  # upper-case escape, high half alone at the end
    ],
)
def test_a_lone_surrogate_anywhere_is_named(body: bytes, where: str) -> None:
    with pytest.raises(APIError) as raised:
        check_json_body(body)
    assert raised.value.status == 400
    assert raised.value.message.startswith(where), raised.value.message
    assert raised.value.param == where.split(".")[0].split("[")[0]


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "\\ud83d\\ude00"}',  # a pair: one emoji
        b'{"prompt": "\\\\ud800"}',  # an escaped backslash then the letters ud800
        "{\"prompt\": \"\U0001f600 caf\u00e9\"}".encode(),  # UTF-8 as it is
        b"not json \\ud800",  # left to the route's own parsing
    ],
)
def test_valid_text_passes(body: bytes) -> None:
    check_json_body(body)


def _run(app, body: bytes, chunks: int = 1):  # noqa: ANN001, ANN202
    """Drive an ASGI app with one POST; the messages it sent and the body its inner app read."""
    size = -(-len(body) // chunks)
    pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    incoming = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    return sent


def test_the_middleware_refuses_and_hands_valid_bodies_on_whole() -> None:
    seen: list[bytes] = []

    async def inner(scope, receive, send) -> None:  # noqa: ANN001
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = TextEncodingMiddleware(inner)
    good = json.dumps({"prompt": "\U0001f600 fine"}).encode()
    assert _run(app, good, chunks=3)[0]["status"] == 200 and seen == [good]
    refused = _run(app, json.dumps({"prompt": "x\ud800"}).encode())
    assert refused[0]["status"] == 400 and len(seen) == 1  # the handler never saw it
    assert b"lone UTF-16 surrogate" in refused[1]["body"]


def test_an_unhandled_error_is_answered_inside_the_app() -> None:
    async def failing(scope, receive, send) -> None:  # noqa: ANN001
        raise TypeError("a bug")

    sent = _run(UnhandledErrorMiddleware(failing), b"{}")  # no exception escapes to the server
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"])["error"]["code"] == "internal_error"

    async def fails_mid_answer(scope, receive, send) -> None:  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise TypeError("a bug")

    with pytest.raises(TypeError):  # the answer is broken: the server must end the connection
        _run(UnhandledErrorMiddleware(fails_mid_answer), b"{}")
