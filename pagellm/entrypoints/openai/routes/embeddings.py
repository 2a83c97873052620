"""Entrypoints stage: HTTP: embeddings and scores: /v1/embeddings, /v1/score, /v1/rerank (and the
other paths clients use for the same, left out of the schema)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagellm.entrypoints.openai.openapi_docs import EMBEDDING, RERANK, SCORE
from pagellm.entrypoints.openai.protocol import EmbeddingRequest
from pagellm.entrypoints.openai.protocol_score import RerankRequest, ScoreRequest
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.post("/v1/embeddings", responses=EMBEDDING)
async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
    return await services_of(raw).embeddings.create(body, raw)


@router.post("/v1/score", responses=SCORE)
async def create_score(body: ScoreRequest, raw: Request) -> Response:
    return await services_of(raw).scores.score(body, raw)


@router.post("/v1/rerank", responses=RERANK)
async def create_rerank(body: RerankRequest, raw: Request) -> Response:
    return await services_of(raw).scores.rerank(body, raw)


# vLLM serves these too.
router.add_api_route("/score", create_score, methods=["POST"], include_in_schema=False)
for _path in ("/rerank", "/v2/rerank"):
    router.add_api_route(_path, create_rerank, methods=["POST"], include_in_schema=False)
