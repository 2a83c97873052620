"""Entrypoints stage: HTTP: the bodies of /v1/score (vLLM's) and /v1/rerank (Jina's, Cohere's, vLLM's)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pagellm.entrypoints.openai.protocol import EmbeddingUsage, OpenAIModel, PositiveInt, RequestModel, SafeInt

ScoreText = Annotated[str, Field(min_length=1)]


class ScoreRequest(RequestModel):
    """vLLM's /v1/score: text_1 against each of text_2 (1:N), or two lists pairwise (N:N)."""

    model: str | None = None
    text_1: ScoreText | Annotated[list[ScoreText], Field(min_length=1)]
    text_2: ScoreText | Annotated[list[ScoreText], Field(min_length=1)]
    user: str | None = None
    priority: SafeInt = 0


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(RequestModel):
    """The rerank API of Jina, Cohere and vLLM: the documents ordered by relevance to the query."""

    model: str | None = None
    query: ScoreText
    documents: list[ScoreText] = Field(min_length=1)
    top_n: PositiveInt | None = None  # the best n only (default: every document)
    return_documents: bool = True
    user: str | None = None
    priority: SafeInt = 0


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int  # the document's position in the request
    document: RerankDocument | None = None  # with return_documents
    relevance_score: float


class RerankUsage(OpenAIModel):
    total_tokens: int = 0


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
