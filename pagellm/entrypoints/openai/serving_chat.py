"""Entrypoints (HTTP): POST /v1/chat/completions, streamed or not.

The messages become a prompt through the model's own chat template (with the assistant's
turn opened); the prompt text is then encoded without adding special tokens, since the
template writes any BOS itself. One engine request carries all n choices.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.async_llm import NewRequest, OutputStream
from pagellm.entrypoints.openai.errors import APIError, to_api_error
from pagellm.entrypoints.openai.logprobs import chat_logprobs
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    UsageInfo,
)
from pagellm.entrypoints.openai.sampling import (
    common_sampling_fields,
    make_sampling_params,
    structured_outputs,
)
from pagellm.entrypoints.openai.serving_common import (
    ServingContext,
    collect_finals,
    new_request_id,
    usage_of,
)
from pagellm.entrypoints.openai.streaming import (
    SSE_DONE,
    EventStreamResponse,
    cancel_on_disconnect,
    sse_event,
)
from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them; text content parts are joined into one string."""
    result = []
    for index, message in enumerate(messages):
        as_dict = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages[{index}]: only text content parts are supported, "
                        f"got type {part.type!r}.",
                        param="messages",
                    )
                texts.append(part.text)
            as_dict["content"] = "\n".join(texts)
        result.append(as_dict)
    return result


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage]) -> list[int]:
    text = tokenizer.apply_chat_template(message_dicts(messages), add_generation_prompt=True)
    assert isinstance(text, str)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class _Job:
    response_id: str
    model: str
    body: ChatCompletionRequest
    num_top_logprobs: int | None  # None: no logprobs asked for


class ChatServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def _sampling_params(self, body: ChatCompletionRequest) -> tuple[SamplingParams, str]:
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs set to true.", param="top_logprobs"
            )
        fields = common_sampling_fields(body, self.context.vocab_size)
        fields["structured_outputs"], constraint_field = structured_outputs(body)
        fields["max_tokens"] = (
            body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        )
        fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
        return make_sampling_params(fields), constraint_field

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_time = time.time()  # queueing in the server counts toward latency
        context = self.context
        context.check_model(body.model)
        params, constraint_field = self._sampling_params(body)
        await context.compile_constraint(params, constraint_field)
        prompt_ids = chat_prompt_ids(context.tokenizer, body.messages)
        response_id = new_request_id("chatcmpl")
        job = _Job(
            response_id,
            context.served_model_name,
            body,
            (body.top_logprobs or 0) if body.logprobs else None,
        )
        stream = await context.async_llm.add_requests(
            [NewRequest(response_id, prompt_ids, params, body.priority, arrival_time)]
        )
        if body.stream:
            return EventStreamResponse(self._stream(job, stream), on_close=stream.cancel)
        finals = await cancel_on_disconnect(raw, collect_finals(stream))
        return JSONResponse(self._response(job, finals[response_id]).model_dump(mode="json"))

    def _logprobs(
        self, job: _Job, token_ids: list[int], positions: list[PositionLogprobs] | None
    ) -> ChatLogprobs | None:
        if job.num_top_logprobs is None:
            return None
        entries = chat_logprobs(
            self.context.tokenizer, token_ids, positions or [], job.num_top_logprobs
        )
        return ChatLogprobs(content=entries)

    def _response(self, job: _Job, output: RequestOutput) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=completion.index,
                message=ChatResponseMessage(content=completion.text),
                logprobs=self._logprobs(job, completion.token_ids, completion.logprobs),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in sorted(output.outputs, key=lambda c: c.index)
        ]
        return ChatCompletionResponse(
            id=job.response_id, model=job.model, choices=choices, usage=usage_of([output])
        )

    async def _stream(self, job: _Job, stream: OutputStream) -> AsyncIterator[str]:
        body = job.body
        latest: RequestOutput | None = None
        try:
            # The assistant's role opens every choice before any content.
            opening = [
                ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})
                for i in range(body.n)
            ]
            yield self._chunk(job, opening)
            async for output in stream:
                latest = output
                choices = [
                    choice
                    for completion in output.outputs
                    if (choice := self._delta_choice(job, completion))
                ]
                if choices:
                    yield self._chunk(job, choices)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield self._chunk(job, [], usage_of([latest] if latest else []))
        except Exception as e:  # noqa: BLE001 - the status is sent: report in the stream
            yield sse_event(to_api_error(e).body().model_dump_json())
        finally:
            stream.cancel()
        yield SSE_DONE

    def _delta_choice(self, job: _Job, completion: CompletionOutput) -> ChatChunkChoice | None:
        """The chunk choice for what this step added to a completion (None: nothing)."""
        text = completion.delta_text
        if not (text or completion.delta_token_ids or completion.finished):
            return None
        return ChatChunkChoice(
            index=completion.index,
            delta={"content": text} if text or not completion.finished else {},
            logprobs=self._logprobs(job, completion.delta_token_ids, completion.delta_logprobs),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    @staticmethod
    def _chunk(job: _Job, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=job.response_id, model=job.model, choices=choices, usage=usage
        )
        return sse_event(chunk.model_dump_json())
