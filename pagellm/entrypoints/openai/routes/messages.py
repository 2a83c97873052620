"""Entrypoints stage: HTTP: Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.entrypoints.openai.openapi_docs import COUNT_TOKENS, MESSAGES
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.post("/v1/messages", responses=MESSAGES)
async def create_message(body: MessagesRequest, raw: Request) -> Response:
    return await services_of(raw).messages.create(body, raw)


@router.post("/v1/messages/count_tokens", responses=COUNT_TOKENS)
async def count_message_tokens(body: CountTokensRequest, raw: Request) -> Response:
    return await services_of(raw).messages.count_tokens(body)
