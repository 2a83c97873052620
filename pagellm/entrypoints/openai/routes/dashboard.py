"""Entrypoints stage: HTTP: the dashboard's routes: /v1/engine/state (this engine's) and the
page at /dashboard, which the data-parallel router serves too (`add_dashboard_page`)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from pagellm.entrypoints.dashboard import STATIC_DIR

from pagellm.entrypoints.openai.errors import to_api_error
from pagellm.entrypoints.openai.openapi_docs import HEALTH
from pagellm.entrypoints.openai.routes.services import services_of
from pagellm.metrics.dashboard_state import dashboard_state

router = APIRouter()  # this engine's state
page_router = APIRouter()  # the page, whatever serves the state


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


@page_router.get("/dashboard", include_in_schema=False)
async def dashboard_redirect() -> Response:
    return RedirectResponse("/dashboard/")


def add_dashboard_page(app: FastAPI) -> None:
    """/dashboard and its files (a router holds no mounts: the app mounts them)."""
    app.include_router(page_router)
    app.mount("/dashboard", StaticFiles(directory=STATIC_DIR, html=True), name="dashboard")
