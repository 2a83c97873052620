"""Entrypoints (HTTP): what /openapi.json says about errors.

Every route documents the statuses the server can answer with, each with the
OpenAI-shaped error body. FastAPI would document 422 with its own validation body; the
server answers invalid bodies with a 400 in OpenAI's shape instead (errors.py), so the
schema says that.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagellm.entrypoints.openai.protocol import ErrorResponse


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


AUTH = {401: _error("Missing or wrong API key (when the server has one).")}
ENGINE = {
    500: _error("The engine step computing the request failed (internal_error)."),
    503: _error("Too many requests waiting (overloaded), or the engine has stopped (engine_dead)."),
}
BODY = {
    400: _error("An invalid body or field; `param` names it."),
    413: _error("The request body is larger than --max-request-body-bytes."),
}
GENERATION = {**BODY, **AUTH, 404: _error("Unknown model."), **ENGINE}
TOKENS = {**BODY, **AUTH}
READ = {**AUTH}
HEALTH = {503: _error("The engine has stopped.")}


def install_openapi(app: FastAPI) -> None:
    """Generate the schema once, without FastAPI's 422 entries and their models."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
