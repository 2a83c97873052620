"""Entrypoints stage: HTTP: POST /v1/score (vLLM's) and POST /v1/rerank (Jina's, Cohere's and vLLM's).

Both score text pairs as entrypoints/scoring.py says: a cross-encoder (a sequence
classifier with one label) reads each pair as one prompt, any other model compares the
two texts' embeddings. The pairs' prompts are added as one group of prompt-only requests,
so either every score is computed or the request fails as a whole. /v1/rerank scores the
query against each document and answers them most relevant first, `top_n` of them.
"""

from __future__ import annotations

import asyncio

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.async_requests import NewRequest
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import EmbeddingUsage
from pagellm.entrypoints.openai.protocol_score import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagellm.entrypoints.openai.request_limits import check_text_length
from pagellm.entrypoints.openai.serving_common import ServingContext, collect_finals, new_request_id
from pagellm.entrypoints.openai.streaming import cancel_on_disconnect
from pagellm.entrypoints.scoring import plan_scoring
from pagellm.errors import InvalidRequestError
from pagellm.lora.request import LoRARequest


class ScoreServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def score(self, body: ScoreRequest, raw: Request) -> Response:
        adapter = self.context.check_model(body.model)
        response_id = new_request_id("score")
        scores, prompt_tokens = await self._scores(
            raw, adapter, response_id, body.text_1, body.text_2, "text_1", "text_2", body.priority
        )
        response = ScoreResponse(
            id=response_id,
            created=int(time.time()),
            model=self.context.model_name(adapter),
            data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )
        return JSONResponse(response.model_dump(mode="json"))

    async def rerank(self, body: RerankRequest, raw: Request) -> Response:
        adapter = self.context.check_model(body.model)
        response_id = new_request_id("rerank")
        scores, prompt_tokens = await self._scores(
            raw, adapter, response_id, body.query, body.documents, "query", "documents", body.priority
        )
        # Most relevant first; equal scores keep the documents' order.
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=body.documents[i]) if body.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        response = RerankResponse(
            id=response_id, model=self.context.model_name(adapter), usage=RerankUsage(total_tokens=prompt_tokens),
            results=results,
        )  # fmt: skip
        return JSONResponse(response.model_dump(mode="json", exclude_none=True))

    async def _scores(
        self,
        raw: Request,
        adapter: LoRARequest | None,
        response_id: str,
        text_1: str | list[str],
        text_2: str | list[str],
        first_field: str,
        second_field: str,
        priority: int,
    ) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens computed for them."""
        arrival_time = time.time()
        context = self.context
        engine = context.async_llm.engine
        for texts, field in ((text_1, first_field), (text_2, second_field)):
            for text in [texts] if isinstance(texts, str) else texts:
                check_text_length(context.limits, text, field)
        try:
            # A cross-encoder's pairs are encoded here: on a worker thread, off the event loop.
            plan = await asyncio.to_thread(
                plan_scoring, engine.model_config, context.tokenizer, text_1, text_2, first_field, second_field
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.parameter) from None
        limit = context.limits.max_prompts_per_request
        if len(plan.pairs) > limit:
            raise APIError(400, f"the request scores {len(plan.pairs)} pairs; at most {limit}.", param=second_field)
        engine_ids = [f"{response_id}-{i}" for i in range(len(plan.prompts))]
        requests = [
            NewRequest(rid, prompt, plan.params, priority, arrival_time, lora_request=adapter)
            for rid, prompt in zip(engine_ids, plan.prompts, strict=True)
        ]
        try:
            stream = await context.add_requests(requests, "")
        except InvalidRequestError as e:
            if e.parameter not in ("prompt", "input"):
                raise
            # The engine's word for it (a text, or a pair, too long for the context); a pair's
            # prompt holds the second field's text.
            raise APIError(400, f"{second_field}: {e}", param=second_field) from None
        finals = await cancel_on_disconnect(raw, collect_finals(stream))
        pooled = []
        for engine_id in engine_ids:
            output = finals[engine_id]
            if output.embedding is None:  # aborted (the server is shutting down)
                raise APIError(503, "The request was aborted before its scores were computed.")
            pooled.append(output.embedding)
        prompt_tokens = sum(len(finals[engine_id].prompt_token_ids) for engine_id in engine_ids)
        return plan.scores(pooled), prompt_tokens
