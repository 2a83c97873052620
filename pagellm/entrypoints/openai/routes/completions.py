"""Entrypoints stage: HTTP: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi_docs import CHAT, COMPLETION, INPUT_TOKENS
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.post("/v1/completions", responses=COMPLETION)
async def create_completion(body: CompletionRequest, raw: Request) -> Response:
    return await services_of(raw).completions.create(body, raw)


@router.post("/v1/chat/completions", responses=CHAT)
async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
    return await services_of(raw).chat.create(body, raw)


@router.post("/v1/chat/completions/input_tokens", responses=INPUT_TOKENS)
async def count_chat_input_tokens(body: ChatCompletionRequest, raw: Request) -> Response:
    return await services_of(raw).chat.count_input_tokens(body)
