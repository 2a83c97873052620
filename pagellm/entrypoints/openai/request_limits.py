"""Entrypoints stage: HTTP: limits on what a client controls (limits_config.py: defaults and
flags), checked before a request costs anything, each refusal a 4xx naming the field:
the body's size (413, checked as the bytes arrive, before any parsing), the number of
prompts in one completions request, n, stop strings (how many, how long), logit_bias
entries, chat messages (how many, how long) and the characters of a text prompt or input. The prompt's tokens and max_tokens are
bounded by max_model_len, logprobs by the engine's --max-logprobs.
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.limits_config import RequestLimits
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields


def check_sampling(limits: RequestLimits, body: SamplingFields) -> None:
    if body.n > limits.max_n:
        raise APIError(400, f"n is {body.n}; this server allows at most {limits.max_n}.", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stop) > limits.max_stop_strings:
        raise APIError(
            400, f"stop has {len(stop)} strings; this server allows at most {limits.max_stop_strings}.", param="stop"
        )
    for text in stop:
        if len(text) > limits.max_stop_string_length:
            raise APIError(
                400, f"a stop string is {len(text)} characters long; at most {limits.max_stop_string_length}.",
                param="stop",
            )  # fmt: skip
    if body.stop_token_ids is not None and len(body.stop_token_ids) > limits.max_stop_strings:
        raise APIError(
            400, f"stop_token_ids has {len(body.stop_token_ids)} ids; at most {limits.max_stop_strings}.",
            param="stop_token_ids",
        )  # fmt: skip
    if body.logit_bias is not None and len(body.logit_bias) > limits.max_logit_bias_entries:
        raise APIError(
            400, f"logit_bias has {len(body.logit_bias)} entries; at most {limits.max_logit_bias_entries}.",
            param="logit_bias",
        )  # fmt: skip


def check_completion(limits: RequestLimits, body: CompletionRequest, prompts: list[str | list[int]]) -> None:
    check_sampling(limits, body)
    if len(prompts) > limits.max_prompts_per_request:
        raise APIError(
            400, f"the request has {len(prompts)} prompts; at most {limits.max_prompts_per_request}.", param="prompt"
        )
    for prompt in prompts:
        check_text_length(limits, prompt, "prompt")


def check_text_length(limits: RequestLimits, text: object, param: str) -> None:
    """A text prompt or input is bounded as a chat message's content is (--max-message-chars):
    checked before it is encoded."""
    if isinstance(text, str) and len(text) > limits.max_message_chars:
        raise APIError(400, f"{param} has {len(text)} characters; at most {limits.max_message_chars}.", param=param)


def check_chat(limits: RequestLimits, body: ChatCompletionRequest) -> None:
    check_sampling(limits, body)
    check_messages(limits, body.messages)


def check_messages(limits: RequestLimits, messages: list[ChatMessage]) -> None:
    """How many messages, and how much content in each (a list's text parts together)."""
    if len(messages) > limits.max_messages:
        raise APIError(400, f"{len(messages)} messages; at most {limits.max_messages}.", param="messages")
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, str):
            length = len(content)
        elif content is None:
            length = 0
        else:
            length = sum(len(part.text) for part in content)
        if length > limits.max_message_chars:
            raise APIError(
                400, f"messages[{index}] has {length} characters of content; at most {limits.max_message_chars}.",
                param="messages",
            )  # fmt: skip


class BodySizeLimitMiddleware:
    """413 for a body over the limit: from Content-Length when the client sends one, else
    as the bytes arrive (the handler never sees more than the limit)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_upload_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # File uploads (POST /v1/files) have their own limit: a batch's input is large.
        self.max_upload_bytes = max_upload_bytes or max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_upload_bytes if scope.get("path") == "/v1/files" else self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._refuse(scope, receive, send, limit)
                return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI passes an HTTPException from body reading through (any
                    # other error there becomes its own 400): the error handler answers.
                    raise HTTPException(413, self._message(limit))
            return message

        await self.app(scope, counted_receive, send)

    @staticmethod
    def _message(limit: int) -> str:
        return f"The request body is larger than this server's limit of {limit} bytes."

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        await APIError(413, self._message(limit)).response(scope.get("path", ""))(scope, receive, send)
