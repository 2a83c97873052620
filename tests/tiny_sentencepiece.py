"""A tiny SentencePiece ("llama") vocabulary as GGUF tokenizer metadata: the tokenizer's
and the detokenizer's tests build their tokenizer from it."""

from __future__ import annotations

from typing import Any

from pagellm.tokenizer.gguf_tokenizer import TokenType

S = "\u2581"  # SentencePiece's space
CHARS = list("abcdefghijklmnopqrstuvwxyz") + [S, ",", ".", "!", "?", "'", "H", "T"]
# Best-scored first: SentencePiece joins the best-scored pair first.
# Every piece is the join of two earlier tokens, as in a trained vocabulary.
PIECES = [
    "he", "ll", "llo", "hello", S + "hello", S + "w", "or", S + "wor", "ld", S + "world", "th", S + "th",
    S + "the", "in", "ing", S + "t", "es", "est", S + "test", "is", S + "is", S + "a", S + "to", "en", "ken",
    S + "token", "iz", "er", "izer", S + "H", S + "He", S + "Hello", S + S, S + S + S, "s" + S,
]  # fmt: skip
USER_DEFINED = "<tool>"


def tiny_sentencepiece_fields(**overrides: Any) -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + CHARS + PIECES + [USER_DEFINED]
    token_types = (
        [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
        + [TokenType.BYTE] * 256
        + [TokenType.NORMAL] * (len(CHARS) + len(PIECES))
        + [TokenType.USER_DEFINED]
    )
    scores = (
        [0.0] * (3 + 256)
        + [-1000.0 - i for i in range(len(CHARS))]
        + [-1.0 - i for i in range(len(PIECES))]
        + [0.0]
    )
    fields: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [int(t) for t in token_types],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}",
    }
    fields.update(overrides)
    return {key: value for key, value in fields.items() if value is not None}
