"""Entrypoints stage: HTTP: POST /v1/embeddings.

Each input (a text, or a list of token ids) becomes one embedding request of the engine:
its prompt runs through the scheduler like any prefill (batched with generation, chunked,
prefix-cached) and the runner pools its final hidden states (the model's pooling, L2-
normalised unless `normalize` is false). The inputs are added as one group, so either all
are embedded or the request fails as a whole. `encoding_format` "base64" carries each
embedding as its little-endian float32 bytes, which is what the openai client decodes.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.config.model import ModelConfig
from pagellm.engine.async_requests import NewRequest
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from pagellm.entrypoints.openai.request_limits import check_text_length
from pagellm.entrypoints.openai.serving_common import ServingContext, collect_finals, new_request_id
from pagellm.entrypoints.openai.serving_completion import normalize_prompts
from pagellm.entrypoints.openai.streaming import cancel_on_disconnect
from pagellm.errors import InvalidRequestError
from pagellm.pooling_params import PoolingParams


def embedding_dimensions(config: ModelConfig) -> tuple[int, ...]:
    """The `dimensions` a request may ask of this model: its own size (no shortening), and
    its Matryoshka sizes where it declares them (any size up to its own when it declares
    only is_matryoshka: then nothing narrower is listed)."""
    sizes = {config.hidden_size, *(config.matryoshka_dimensions or ())}
    if config.is_matryoshka and not config.matryoshka_dimensions:
        return ()
    return tuple(sorted(sizes))


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


class EmbeddingServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response:
        arrival_time = time.time()
        context = self.context
        adapter = context.check_model(body.model)
        inputs = normalize_prompts(body.input)
        limit = context.limits.max_prompts_per_request
        if len(inputs) > limit:
            raise APIError(400, f"the request has {len(inputs)} inputs; at most {limit}.", param="input")
        for item in inputs:
            check_text_length(context.limits, item, "input")
        try:
            params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.parameter) from None
        response_id = new_request_id("embd")
        engine_ids = [f"{response_id}-{i}" for i in range(len(inputs))]
        try:
            stream = await context.add_requests(
                [
                    NewRequest(rid, item, params, body.priority, arrival_time, lora_request=adapter)
                    for rid, item in zip(engine_ids, inputs)
                ],
                "",
            )
        except InvalidRequestError as e:
            if e.parameter != "prompt":
                raise
            # The engine's word for it; this endpoint's field is `input`.
            raise APIError(400, str(e).replace("prompt", "input", 1), param="input") from None
        finals = await cancel_on_disconnect(raw, collect_finals(stream))
        data, prompt_tokens = [], 0
        for index, engine_id in enumerate(engine_ids):
            output = finals[engine_id]
            if output.embedding is None:  # aborted (the server is shutting down)
                raise APIError(503, "The request was aborted before its embeddings were computed.")
            data.append(EmbeddingData(embedding=encode_embedding(output.embedding, body.encoding_format), index=index))
            prompt_tokens += len(output.prompt_token_ids)
        response = EmbeddingResponse(
            data=data, model=context.model_name(adapter), usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        )
        return JSONResponse(response.model_dump(mode="json"))
