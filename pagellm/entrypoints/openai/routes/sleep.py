"""Entrypoints stage: HTTP: sleep and wake-up, as vLLM's: POST /sleep?level=1|2, POST /wake_up,
GET /is_sleeping. A request that comes while the engine sleeps wakes it and waits."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.openapi_docs import READ, SLEEP
from pagellm.entrypoints.openai.routes.services import services_of

router = APIRouter()


@router.post("/sleep", responses=SLEEP)
async def sleep(raw: Request, level: Annotated[int, Query(ge=1, le=2)] = 1) -> Response:
    """Free the KV cache (level 1) or the weights too (level 2) once the requests in flight
    have finished; answers when asleep."""
    await services_of(raw).async_llm.sleep(level)
    return JSONResponse({"is_sleeping": True, "level": services_of(raw).async_llm.sleep_level})


@router.post("/wake_up", responses=SLEEP)
async def wake_up(raw: Request) -> Response:
    await services_of(raw).async_llm.wake_up()
    return JSONResponse({"is_sleeping": False})


@router.get("/is_sleeping", responses=READ)
async def is_sleeping(raw: Request) -> Response:
    level = services_of(raw).async_llm.sleep_level
    return JSONResponse({"is_sleeping": level is not None, "level": level or 0})
