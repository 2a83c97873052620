"""Entrypoints stage: HTTP: what the routes of one server call: its serving objects, held on the app."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.anthropic.serving import MessagesServing
from pagellm.entrypoints.ollama.serving import OllamaServing
from pagellm.entrypoints.openai.serving_chat import ChatServing
from pagellm.entrypoints.openai.serving_common import ServingContext
from pagellm.entrypoints.openai.serving_completion import CompletionServing
from pagellm.entrypoints.openai.serving_embedding import EmbeddingServing
from pagellm.entrypoints.openai.serving_lora import AdapterRegistry
from pagellm.entrypoints.openai.serving_responses import ResponsesServing
from pagellm.entrypoints.openai.serving_score import ScoreServing
from pagellm.entrypoints.openai.serving_tokens import TokenServing


@dataclass(frozen=True)
class Services:
    """One engine's serving objects, built once by build_app."""

    async_llm: AsyncLLM
    name: str  # the served model name
    context: ServingContext
    adapters: AdapterRegistry
    completions: CompletionServing
    chat: ChatServing
    responses: ResponsesServing
    messages: MessagesServing
    embeddings: EmbeddingServing
    scores: ScoreServing
    tokens: TokenServing
    ollama: OllamaServing
    metrics_registry: Any  # prometheus_client CollectorRegistry
    health_stall_seconds: float = 0.0  # --health-stall-seconds (0: no stall check)
    created: int = field(default_factory=lambda: int(time.time()))  # when the models came to be served


def services_of(request: Request) -> Services:
    return request.app.state.services
