"""Entrypoints stage: scores of text pairs (LLM.score, POST /v1/score, POST /v1/rerank).

A model scores a pair (a query and a document, `text_1` and `text_2`) in one of two ways,
as vLLM does:
- a cross-encoder, i.e. a sequence classifier with one label (a reranker saved as
  *ForSequenceClassification): the pair is ONE prompt, the tokenizer's pair encoding (what
  HF's `tokenizer(text_1, text_2)` gives: the template's special tokens around and between
  the two), and the score is the sigmoid of the head's logit over its last token, as
  sentence-transformers' CrossEncoder reports it;
- any other model (a bi-encoder: an embedding model, or a causal LM's last-token state):
  each text is embedded on its own (the model's pooling, L2-normalised) and the score is
  the cosine similarity of the two embeddings.
Either way the prompts are ordinary prompt-only requests of the engine (batched, chunked,
prefix-cached: a query repeated across documents is computed once in the bi-encoder case
and shares its first blocks in the cross-encoder case).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagellm.config.model import ModelConfig
from pagellm.errors import InvalidRequestError
from pagellm.pooling_params import PoolingParams
from pagellm.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class ScoringPlan:
    """The engine requests that score some pairs, and how their outputs become scores."""

    prompts: list[str | list[int]]  # per engine request: a text (bi-encoder) or a pair's token ids
    params: PoolingParams
    pairs: list[tuple[int, int]]  # per pair: the prompts its score reads (a, a) or (a, b)
    cross_encoder: bool

    def scores(self, pooled: Sequence[Sequence[float]]) -> list[float]:
        """Each pair's score from the engine's pooled outputs (one per prompt, in order)."""
        if self.cross_encoder:
            return [_sigmoid(pooled[a][0]) for a, _ in self.pairs]
        return [sum(x * y for x, y in zip(pooled[a], pooled[b], strict=True)) for a, b in self.pairs]


def _sigmoid(logit: float) -> float:
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))


def _texts(value: str | Sequence[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise InvalidRequestError(f"{field} must hold at least one text.", field)
    for text in texts:
        if not isinstance(text, str):
            raise InvalidRequestError(f"{field} must be a text or a list of texts, got {type(text).__name__}.", field)
        if not text:
            raise InvalidRequestError(f"{field} must not hold an empty text.", field)
    return texts


def pair_indices(
    first: list[str], second: list[str], first_field: str = "text_1", second_field: str = "text_2"
) -> list[tuple[int, int]]:
    """vLLM's pairing: one first text against each second text (1:N, 1:1), or the two
    lists pairwise (N:N, equal lengths); also each first text against one second (N:1)."""
    if len(first) == 1:
        return [(0, j) for j in range(len(second))]
    if len(second) == 1:
        return [(i, 0) for i in range(len(first))]
    if len(first) != len(second):
        raise InvalidRequestError(
            f"{first_field} holds {len(first)} texts and {second_field} {len(second)}: score one text against many, "
            "or two lists of the same length pairwise.",
            second_field,
        )
    return [(i, i) for i in range(len(first))]


def plan_scoring(
    config: ModelConfig,
    tokenizer: Tokenizer,
    text_1: str | Sequence[str],
    text_2: str | Sequence[str],
    first_field: str = "text_1",
    second_field: str = "text_2",
) -> ScoringPlan:
    """The requests that score text_1 against text_2 on this model (InvalidRequestError
    naming the field for empty or mismatched inputs, or a classifier of several labels)."""
    first, second = _texts(text_1, first_field), _texts(text_2, second_field)
    pairs = pair_indices(first, second, first_field, second_field)
    if config.num_labels > 1:
        raise InvalidRequestError(
            f"this model is a classifier of {config.num_labels} labels; a score needs a one-label head "
            "(a cross-encoder reranker's).",
            "model",
        )
    if config.num_labels == 1:
        prompts: list[str | list[int]] = [tokenizer.encode_pair(first[i], second[j]) for i, j in pairs]
        return ScoringPlan(prompts, PoolingParams(task="classify"), [(k, k) for k in range(len(pairs))], True)
    texts: list[str | list[int]] = [*first, *second]
    return ScoringPlan(texts, PoolingParams(), [(i, len(first) + j) for i, j in pairs], False)
