"""Entrypoints stage: HTTP: the engine's per-position logprobs in OpenAI's two formats.

Completions use parallel lists (tokens, token_logprobs, top_logprobs, text_offset); chat
uses one entry per token with its `top_logprobs` list. JSON has no -inf, so impossible
tokens are reported with a logprob of -9999.0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagellm.entrypoints.openai.protocol import (
    ChatLogprobToken,
    CompletionLogprobs,
    TopLogprob,
)
from pagellm.outputs import Logprob, PositionLogprobs
from pagellm.tokenizer import Tokenizer

_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def token_text(tokenizer: Tokenizer, token_id: int, logprob: Logprob | None = None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return ranked[:num_top]


class CompletionLogprobsBuilder:
    """Completions-format logprobs; keeps the running text offset across stream chunks."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.text_offset = text_offset

    def build(
        self, token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs | None]
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, position in zip(token_ids, logprobs):
            chosen = position.get(token_id) if position is not None else None
            text = token_text(self.tokenizer, token_id, chosen)
            result.tokens.append(text)
            result.text_offset.append(self.text_offset)
            self.text_offset += len(text)
            result.token_logprobs.append(json_logprob(chosen.logprob) if chosen else None)
            if position is None:
                result.top_logprobs.append(None)
                continue
            # The top alternatives plus the chosen token, as OpenAI reports them.
            top = dict(_top(position, self.num_top))
            if chosen is not None:
                top[token_id] = chosen
            result.top_logprobs.append(
                {token_text(self.tokenizer, t, lp): json_logprob(lp.logprob) for t, lp in top.items()}
            )
        return result


def chat_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[PositionLogprobs],
    num_top: int,
) -> list[ChatLogprobToken]:
    entries = []
    for token_id, position in zip(token_ids, logprobs):
        chosen = position.get(token_id)
        text = token_text(tokenizer, token_id, chosen)
        entries.append(
            ChatLogprobToken(
                token=text,
                logprob=json_logprob(chosen.logprob) if chosen else _FLOOR,
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=(alt := token_text(tokenizer, t, lp)),
                        logprob=json_logprob(lp.logprob),
                        bytes=list(alt.encode("utf-8")),
                    )
                    for t, lp in _top(position, num_top)
                ],
            )
        )
    return entries
