"""Entrypoints stage: HTTP: POST /tokenize and /detokenize with the served model's tokenizer."""

from __future__ import annotations

from pagellm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.request_limits import check_messages
from pagellm.entrypoints.openai.serving_chat import chat_prompt_ids
from pagellm.entrypoints.openai.serving_common import ServingContext


class TokenServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        context = self.context
        context.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            check_messages(context.limits, body.messages)
            token_ids = chat_prompt_ids(context.tokenizer, body.messages)
        else:
            token_ids = context.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        return TokenizeResponse(
            count=len(token_ids), max_model_len=context.max_model_len, tokens=token_ids
        )

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        context = self.context
        context.check_model(body.model)
        context.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=context.tokenizer.decode(body.tokens))
