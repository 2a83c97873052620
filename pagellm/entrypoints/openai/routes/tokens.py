"""Entrypoints stage: HTTP: /tokenize and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagellm.entrypoints.openai.openapi_docs import TOKENS
from pagellm.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.post("/tokenize", responses=TOKENS)
async def tokenize(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
    return await services_of(raw).tokens.tokenize(body)


@router.post("/detokenize", responses=TOKENS)
async def detokenize(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    return services_of(raw).tokens.detokenize(body)
