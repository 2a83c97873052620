"""Entrypoints stage: HTTP: the status routes: /health, /metrics, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagellm.entrypoints.openai import metrics
from pagellm.entrypoints.openai.errors import APIError, to_api_error
from pagellm.entrypoints.openai.openapi_docs import HEALTH, METRICS, MODEL_BY_ID, READ
from pagellm.entrypoints.openai.protocol import ModelCard, ModelList
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.get("/health", responses=HEALTH)
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 naming why when its thread died, or when requests
    are in flight and no step has completed for --health-stall-seconds (a step that hangs:
    a stuck kernel, a collective that never returns). It recovers with the next step."""
    services = services_of(request)
    error = services.async_llm.dead_error
    if error is not None:
        return to_api_error(error).response()
    limit = services.health_stall_seconds
    stalled = services.async_llm.stalled_for()
    if limit and stalled is not None and stalled > limit:
        message = (
            f"The engine has completed no step for {stalled:.0f} s while requests are in flight "
            f"(--health-stall-seconds {limit:g})."
        )
        return APIError(503, message, code="engine_stalled").response()
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse, responses=METRICS)
async def get_metrics(request: Request) -> Response:
    body, content_type = metrics.render(services_of(request).metrics_registry)
    return Response(body, media_type=content_type)


def _model_cards(request: Request) -> list[ModelCard]:
    services = services_of(request)
    name, max_model_len = services.name, services.context.max_model_len
    # No file path in `root`: clients need not learn the server's file layout.
    cards = [ModelCard(id=name, created=services.created, root=name, max_model_len=max_model_len)]
    cards += [
        ModelCard(id=adapter, created=services.created, root=adapter, parent=name, max_model_len=max_model_len)
        for adapter in services.adapters.names()
    ]
    return cards


@router.get("/v1/models", responses=READ)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=_model_cards(request))


@router.get("/v1/models/{model:path}", responses=MODEL_BY_ID)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """One served model (or LoRA adapter) by name: the SDKs' models.retrieve. A name may
    hold slashes (org/model), hence the path converter."""
    cards = _model_cards(request)
    for card in cards:
        if card.id == model:
            return card
    served = ", ".join(f"`{card.id}`" for card in cards)
    raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.", param="model", code="model_not_found")
