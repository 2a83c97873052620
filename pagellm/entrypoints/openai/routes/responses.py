"""Entrypoints stage: HTTP: the Responses API: /v1/responses and a stored response's routes."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi_docs import INPUT_TOKENS, RESPONSE_BY_ID, RESPONSES, add_route_per_method
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.post("/v1/responses", responses=RESPONSES)
async def create_response(body: ResponsesRequest, raw: Request) -> Response:
    return await services_of(raw).responses.create(body, raw)


@router.post("/v1/responses/input_tokens", responses=INPUT_TOKENS)
async def count_response_input_tokens(body: ResponsesRequest, raw: Request) -> Response:
    return await services_of(raw).responses.count_input_tokens(body)


async def response_by_id(response_id: str, raw: Request) -> Response:
    responses = services_of(raw).responses
    return responses.delete(response_id) if raw.method == "DELETE" else responses.retrieve(response_id)


# One route for both methods, so that a 405 on the path names both in `Allow`; each method
# its own operation in the schema.
add_route_per_method(router, "/v1/responses/{response_id}", response_by_id, ["DELETE", "GET"], responses=RESPONSE_BY_ID)


@router.get("/v1/responses/{response_id}/input_items", responses=RESPONSE_BY_ID)
async def list_input_items(
    response_id: str, raw: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc", after: str | None = None, before: str | None = None,
) -> Response:  # fmt: skip
    return services_of(raw).responses.input_items(response_id, limit, order, after, before)


@router.post("/v1/responses/{response_id}/cancel", responses=RESPONSE_BY_ID)
async def cancel_response(response_id: str, raw: Request) -> Response:
    return await services_of(raw).responses.cancel(response_id)
