"""Entrypoints stage: HTTP: POST /tokenize and /detokenize with the served model's tokenizer."""

from __future__ import annotations

from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.request_limits import check_messages, check_text_length
from pagellm.entrypoints.openai.serving_chat import chat_prompt_text, harmony_chat_prompt
from pagellm.entrypoints.openai.serving_common import ServingContext


class TokenServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """Counting tokens is what /tokenize is for: a text longer than the context is
        counted, not refused (within the character limit of a message)."""
        context = self.context
        context.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            check_messages(context.limits, body.messages)
            chat = ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )  # fmt: skip
            prompt = harmony_chat_prompt(chat)[0] if context.harmony else chat_prompt_text(context.tokenizer, body.messages, chat)
            text, add_special_tokens, param = prompt, False, "prompt"
        else:
            check_text_length(context.limits, body.prompt, "prompt")
            text, add_special_tokens, param = body.prompt, body.add_special_tokens, "prompt"
        token_ids = await context.async_llm.tokenize(text, add_special_tokens, param, within_context=False)
        return TokenizeResponse(
            count=len(token_ids), max_model_len=context.max_model_len, tokens=token_ids
        )

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        context = self.context
        context.check_model(body.model)
        context.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=context.tokenizer.decode(body.tokens))
