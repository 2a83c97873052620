"""Entrypoints stage: HTTP: a JSON body whose strings are not valid Unicode is refused with a
400 naming the field, before any handler sees it.

JSON may spell a UTF-16 surrogate as an escape (`"\\ud800"`); a JavaScript client that
cuts a string inside an emoji sends one alone. Python's JSON decoder turns it into a str
that holds a lone surrogate, which cannot be encoded as UTF-8: the tokenizer refuses it,
and so does the JSON encoder of any answer that would echo it. Every route would need its
own guard, so the check runs once here, on the body's bytes: a lone surrogate can only
come from a `\\uD800`-`\\uDFFF` escape (or raw bytes that encode one, which the decoder
lets through), so a body without either is passed on unread; one with them (a client
that escapes every emoji as a pair) is decoded and its strings checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import APIError
from pagellm.tokenizer.unicode_text import lone_surrogate, surrogate_message

# A surrogate's escape (\uD800-\uDFFF, any case) or its raw UTF-8-like bytes (ED A0-BF).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _strings(value: object, path: str) -> Iterator[tuple[str, str]]:
    """(path, string) for every string in a decoded JSON value, object keys included."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            yield where, key
            yield from _strings(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]" if path else f"[{index}]")


def check_json_body(body: bytes) -> None:
    """Raise a 400 APIError naming the first string of the JSON `body` that holds a lone
    surrogate. A body that is not JSON is left to the route's own parsing."""
    if not _MAYBE_SURROGATE.search(body):
        return
    try:
        value = json.loads(body)
    except ValueError:
        return
    for path, text in _strings(value, ""):
        index = lone_surrogate(text)
        if index is not None:
            raise APIError(400, surrogate_message(path or "the body", text, index), param=path.split(".")[0].split("[")[0] or None)


class TextEncodingMiddleware:
    """Reads a JSON request's body, refuses it when a string in it is not valid Unicode
    (check_json_body), and hands the same bytes on. Sits inside the body size limit, so
    what it buffers is bounded."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            try:
                message = await receive()
            except HTTPException as error:  # the size limit outside, as the bytes arrive
                await APIError(error.status_code, str(error.detail)).response(scope.get("path", ""))(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client went away: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            check_json_body(body)
        except APIError as error:
            await error.response(scope.get("path", ""))(scope, receive, send)
            return
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _is_json(scope: Scope) -> bool:
    """Whether the routes will read the body as JSON (FastAPI does without a content type)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return b"json" in value.lower()
    return True


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
