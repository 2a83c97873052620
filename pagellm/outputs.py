"""Output stage: what users get back for a request.

Each engine step yields a RequestOutput for every request that progressed. A completion
carries its cumulative `text` / `token_ids` / `logprobs` and, for streaming, the part
added by this step (`delta_text`, `delta_token_ids`, `delta_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token at one position, with its rank in the distribution."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# For one position: token id -> Logprob (the top-k, plus the sampled token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request (index i of its n)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one entry per token, if asked for
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """One finished request's timings and counts (times: time.time() seconds); on the
    final RequestOutput. Counts are over all its completions."""

    arrival_time: float
    first_scheduled_time: float | None  # None: never computed (aborted while waiting)
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served, those of its tier included
    num_tier_cached_tokens: int  # of those, loaded from the prefix cache's disk tier
    num_generation_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative decoding: proposed tokens checked
    num_accepted_tokens: int = 0  # ... and accepted


@dataclass
class RequestOutput:
    """The state of a request after a step: the completion(s) so far, or the final ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # One entry per prompt token (None for the first), if prompt_logprobs was asked for.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Set when the request ended because an engine step it was in failed (finish_reason
    # "error"): what failed. The other requests of the engine are not affected.
    error: str | None = None
    # An embedding request (LLM.embed, /v1/embeddings): its pooled embedding, once
    # finished (its one completion is empty, finish_reason "stop").
    embedding: list[float] | None = None
    metrics: RequestMetrics | None = None  # once finished


@dataclass
class EmbeddingOutput:
    """One input's embedding: the pooled final hidden state (L2-normalised unless asked not to)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per input, as vLLM shapes it (`output.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # input tokens served from the prefix cache (last-token pooling)


@dataclass
class ScoringOutput:
    """One pair's score: a cross-encoder's sigmoid of its logit, or the cosine similarity
    of the two texts' embeddings (entrypoints/scoring.py)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair, as vLLM shapes it (`output.outputs.score`)."""

    request_id: str
    prompt_token_ids: list[int]  # the pair's one prompt (cross-encoder), or both texts' tokens
    outputs: ScoringOutput
    finished: bool = True

