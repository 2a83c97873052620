"""Entrypoints stage: HTTP: Ollama's API under /api (entrypoints/ollama/serving.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.ollama.protocol import OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest, OllamaShowRequest
from pagellm.entrypoints.openai.openapi_docs import OLLAMA, OLLAMA_GENERATED, OLLAMA_READ
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.post("/api/chat", responses=OLLAMA_GENERATED)
async def ollama_chat(body: OllamaChatRequest, raw: Request) -> Response:
    return await services_of(raw).ollama.chat_completion(body, raw)


@router.post("/api/generate", responses=OLLAMA_GENERATED)
async def ollama_generate(body: OllamaGenerateRequest, raw: Request) -> Response:
    return await services_of(raw).ollama.generate(body, raw)


@router.post("/api/embed", responses=OLLAMA)
async def ollama_embed(body: OllamaEmbedRequest, raw: Request) -> Response:
    return await services_of(raw).ollama.embed(body, raw)


@router.post("/api/show", responses=OLLAMA)
async def ollama_show(body: OllamaShowRequest, raw: Request) -> Response:
    return services_of(raw).ollama.show(body)


@router.get("/api/tags", responses=OLLAMA_READ)
async def ollama_tags(raw: Request) -> Response:
    return services_of(raw).ollama.tags()


@router.get("/api/ps", responses=OLLAMA_READ)
async def ollama_ps(raw: Request) -> Response:
    return services_of(raw).ollama.ps()


@router.get("/api/version", responses=OLLAMA_READ)
async def ollama_version(raw: Request) -> Response:
    return services_of(raw).ollama.version()
