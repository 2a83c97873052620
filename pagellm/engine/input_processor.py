"""Engine stage: validate and tokenize a prompt into a Request for the scheduler."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagellm.errors import InvalidRequestError
from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenizedPrompt:
    """A text prompt already encoded by this engine's tokenizer (AsyncLLM encodes off the
    engine thread, so that a long prompt never holds up a step)."""

    text: str | None  # None: not reported back (a chat prompt rendered from messages)
    token_ids: list[int]


PromptInput = str | Sequence[int] | TokenizedPrompt


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids), validated."""
        if isinstance(prompt, TokenizedPrompt):
            ids = prompt.token_ids
            if not ids or min(ids) < 0 or max(ids) >= self.vocab_size:
                raise InvalidRequestError("the prompt's token ids are not this tokenizer's", "prompt")
            return prompt.text, ids
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", "prompt")
            self.check_length(prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                "prompt",
            )
        token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt has no tokens", "prompt")
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidRequestError(
                    f"prompt token ids must be integers, got {token!r}", "prompt"
                )
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token id {token} is out of range [0, {self.vocab_size})", "prompt"
                )
        return None, token_ids

    def check_length(self, text: str, parameter: str = "prompt") -> None:
        """Refuse a text sure to be longer than the context before encoding it (encoding
        megabytes takes seconds; the tokenizer's bound on tokens per character is exact)."""
        at_least = self.tokenizer.min_tokens(text)
        if at_least > self.max_model_len:
            raise InvalidRequestError(
                f"the {parameter} has {len(text)} characters, so at least {at_least} tokens, "
                f"but max_model_len is {self.max_model_len}",
                parameter,
            )

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        background: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        num_prompt = len(prompt_token_ids)
        if pooling is not None:  # an embedding generates nothing: its input may fill the context
            if num_prompt > self.max_model_len:
                raise InvalidRequestError(
                    f"the input has {num_prompt} tokens, but max_model_len is {self.max_model_len}", "input"
                )
            max_tokens = None
        else:
            if num_prompt >= self.max_model_len:
                raise InvalidRequestError(
                    f"the prompt has {num_prompt} tokens, but max_model_len is "
                    f"{self.max_model_len}: no room for any new token",
                    "prompt",
                )
            max_tokens = params.max_tokens
            if max_tokens is None:
                max_tokens = self.max_model_len - num_prompt
        return Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            background=background,
            pooling_params=pooling,
            max_tokens=max_tokens,
            lora_request=lora_request,
        )
