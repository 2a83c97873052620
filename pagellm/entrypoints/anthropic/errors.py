"""Entrypoints stage: HTTP: errors on the Messages API's paths in Anthropic's shape,
`{"type": "error", "error": {"type": ..., "message": ...}}`, with its statuses (an
overloaded server is 529). Every other path keeps OpenAI's shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pagellm.entrypoints.anthropic.protocol import AnthropicError, AnthropicErrorDetail

MESSAGES_PATH = "/v1/messages"

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error",
}  # fmt: skip


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(status: int, message: str) -> AnthropicError:
    return AnthropicError(error=AnthropicErrorDetail(type=_TYPE_BY_STATUS.get(status, "api_error"), message=message))


def anthropic_error_response(status: int, message: str) -> JSONResponse:
    # Anthropic answers an overloaded service with 529.
    return JSONResponse(anthropic_error_body(status, message).model_dump(mode="json"), status_code=529 if status == 503 else status)
