"""Entrypoints stage: HTTP: the API key check, before any body is read.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which gets in the way of
streaming and of noticing disconnects). Health and metrics stay open so that probes and
scrapers need no secret.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import APIError

# The dashboard is an operator view like /metrics (a browser page cannot send the key);
# the API's schema is public knowledge that client generators and fuzzers start from.
OPEN_PATHS = frozenset({"/health", "/metrics", "/v1/engine/state", "/dashboard", "/openapi.json"})
OPEN_PREFIXES = ("/dashboard/",)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        is_open = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if scope["type"] != "http" or is_open or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = APIError(
            401, "Invalid or missing API key.", code="invalid_api_key"
        ).response(path)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
        for name, value in scope.get("headers", ()):
            # Constant-time, so that timing does not reveal the key.
            if name == b"authorization" and hmac.compare_digest(value, self._expected):
                return True
            if name == b"x-api-key" and hmac.compare_digest(value, self._key):
                return True
        return False
