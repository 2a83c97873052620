"""Entrypoints stage: HTTP: every failure as an OpenAI-shaped error body with the right status.

`{"error": {"message", "type", "param", "code"}}`: 400 for bad input (including malformed
JSON and wrong types, where FastAPI would say 422), 401 for a missing or wrong API key,
404 for an unknown model or route, 503 when the engine is overloaded or stopped. Anything
else is a bug: it is logged with its traceback and answered 500, in the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.engine.async_requests import EngineDeadError, EngineOverloadedError
from pagellm.entrypoints.anthropic.errors import anthropic_error_response, is_messages_path
from pagellm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagellm.entrypoints.openai.streaming import ClientDisconnected
from pagellm.errors import ChatTemplateError, InvalidRequestError, PagellmError, RequestFailedError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with; raised anywhere in a handler."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        error_type = _TYPE_BY_STATUS.get(self.status, "invalid_request_error")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=error_type, param=self.param, code=self.code)
        )

    def response(self, path: str = "") -> JSONResponse:
        """The answer; on the Messages API's paths in Anthropic's shape."""
        if is_messages_path(path):
            response = anthropic_error_response(self.status, self.message)
        elif path.startswith("/api/"):  # Ollama's API: {"error": "..."}
            response = JSONResponse({"error": self.message}, status_code=self.status)
        else:
            response = JSONResponse(self.body().model_dump(mode="json"), status_code=self.status)
        response.headers.update(self.headers)
        return response


def to_api_error(exc: BaseException) -> APIError:
    """The answer for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.parameter)
    if isinstance(exc, ChatTemplateError):
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, EngineOverloadedError):  # clients' retries wait as long as Retry-After says
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, RequestFailedError):  # logged with its traceback by the engine
        return APIError(500, f"Internal error: {exc}", code="internal_error")
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error")


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 for pydantic/FastAPI validation errors, naming the first bad field."""
    if not errors:
        return APIError(400, "The request body is invalid.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "))
    loc = [part for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    if not loc and first.get("type") == "missing":
        return APIError(400, "The request needs a JSON body.")
    param = str(loc[0]) if loc else None
    messages = [f"{_path(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return APIError(400, "Invalid request: " + "; ".join(messages) + more, param=param)


def _path(loc: Sequence[Any]) -> str:
    parts: list[str] = []
    for part in loc:
        # A tagged union's tag repeats the field it is named after (/tokenize's
        # "prompt" form: prompt.prompt).
        if part != "body" and (not parts or parts[-1] != str(part)):
            parts.append(str(part))
    return ".".join(parts) or "body"


def _flat_routes(routes: Iterable[Any]) -> Iterator[Any]:
    """The routes, those of the routers included into the app among them (FastAPI keeps an
    included router as one entry; the server includes its route groups without a prefix)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _flat_routes(included.routes)
        else:
            yield route


def _allowed_methods(request: Request) -> list[str]:
    """The methods of the routes on the path; a path that is a route of its own (POST
    /v1/responses/input_tokens) is that route's, not also a parametric one's it matches
    (GET /v1/responses/{response_id})."""
    exact: set[str] = set()
    matching: set[str] = set()
    for route in _flat_routes(request.app.router.routes):
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(request.url.path):
            matching |= set(route_methods)
            if getattr(route, "path", None) == request.url.path:
                exact |= set(route_methods)
    return sorted(exact or matching)


class UnhandledErrorMiddleware:
    """A bug's 500, answered inside the app. Starlette answers an exception no handler
    takes in its outermost layer and then raises it again, so that the server logs
    "Exception in ASGI application" and closes the connection: a keep-alive client's next
    request on it fails. Here the 500 is answered (and the traceback logged once) and the
    connection stays usable; an exception after the answer started still ends it, since
    the answer is broken."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            if started:
                raise
            await to_api_error(exc).response(scope.get("path", ""))(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response(request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc.errors()).response(request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        response = APIError(exc.status_code, str(exc.detail)).response(request.url.path)
        # The router's own headers (a 405's Allow: the methods the path takes) stay.
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        if exc.status_code == 405:
            # The router names the first route on the path only; a path with a route per
            # method (GET and POST /v1/files) takes them all.
            response.headers["Allow"] = ", ".join(_allowed_methods(request))
        return response

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # Not an error of the server's: the client stopped waiting (its timeout) and its
        # engine requests were aborted. Nobody reads this answer; 499 is nginx's word for it.
        logger.info("%s %s: the client disconnected before the answer; its requests were aborted",
                    request.method, request.url.path)  # fmt: skip
        return Response(status_code=499)

    app.add_exception_handler(ClientDisconnected, on_client_gone)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(PagellmError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    # Anything else: the 500 handler of the outermost middleware, still OpenAI-shaped.
    app.add_exception_handler(Exception, on_api_error)
