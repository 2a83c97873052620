"""Entrypoints stage: HTTP: the dashboard's routes: /v1/engine/state and /dashboard (its page
files are mounted by the app: a router holds no mounts)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from pagellm.entrypoints.openai.errors import to_api_error
from pagellm.entrypoints.openai.openapi_docs import HEALTH
from pagellm.entrypoints.openai.routes.services import services_of
from pagellm.metrics.dashboard_state import dashboard_state

router = APIRouter()


@router.get("/v1/engine/state", responses=HEALTH)
async def engine_state(request: Request) -> Response:
    """The block map, queues and time series the dashboard draws."""
    services = services_of(request)
    error = services.async_llm.dead_error
    if error is not None:
        return to_api_error(error).response()
    state = await services.async_llm.query(dashboard_state)
    state["model"] = services.name
    return JSONResponse(state)


@router.get("/dashboard", include_in_schema=False)
async def dashboard_redirect() -> Response:
    return RedirectResponse("/dashboard/")
