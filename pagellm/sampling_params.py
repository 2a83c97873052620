"""Request-level sampling parameters (input stage): what to sample and when to stop."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens, with vLLM's names and defaults.

    temperature 0 means greedy. top_k 0 or -1 means "all tokens".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}.", "n")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}.", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (all tokens) or a positive number, got {self.top_k}.",
                "top_k",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens"
            )
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}.", "min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
                "min_tokens",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative.", "stop_token_ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
