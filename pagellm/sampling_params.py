"""Request-level sampling parameters (input stage): what to sample and when to stop.

Pure Python (no torch), so the scheduler can read them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagellm.errors import InvalidRequestError
from pagellm.structured_outputs_params import StructuredOutputsParams

# Bounds shared with the HTTP server's validation and error messages.
MAX_LOGIT_BIAS = 100.0
PENALTY_RANGE = (-2.0, 2.0)
REPETITION_PENALTY_MAX = 2.0  # in [REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX]
# Below it, a positive logit divided by the penalty overflows float32 (and the penalty itself
# may round to 0): the distribution would be infinities, not a sharper one.
REPETITION_PENALTY_MIN = 0.01
# A temperature below this is greedy: logits divided by it are so far apart that sampling
# picks the most likely token anyway, and a smaller one overflows float32 (1e-40 is 0 there).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens, with vLLM's names and defaults.

    temperature 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy. top_k 0 or -1 means "all tokens". `stop` strings end the
    completion when they appear in its text (cut from the output unless
    include_stop_str_in_output). `logprobs` asks for the top-k log-probabilities at
    each sampled position (the sampled token always included); `prompt_logprobs` the
    same for every prompt position.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    skip_special_tokens: bool = True
    # A constraint on the output (JSON schema, regex, choice, grammar); logprobs then
    # describe the constrained distribution.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Convenience inputs (a single stop string, lists, str keys from JSON) are
        # normalized into immutable forms.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        self._validate()
        if 0.0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    def _validate(self) -> None:
        def fail(name: str, message: str) -> None:
            raise InvalidRequestError(f"{name} {message}", name)

        _check_int("n", self.n)
        if self.n < 1:
            fail("n", f"must be at least 1, got {self.n}.")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            fail("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            fail("top_k", f"must be -1 or 0 (all tokens) or a positive number, got {self.top_k}.")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}.")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not low <= value <= high:
                fail(name, f"must be in [{low}, {high}], got {value}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX:
            fail(
                "repetition_penalty",
                f"must be in [{REPETITION_PENALTY_MIN}, {REPETITION_PENALTY_MAX}], got {self.repetition_penalty}.",
            )
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                fail("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            fail("min_tokens", f"must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(
                "min_tokens",
                f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
            )
        for text in self.stop:
            if not isinstance(text, str):
                fail("stop", f"must be strings, got {text!r}.")
            if not text:
                fail("stop", "strings must not be empty.")
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                fail("stop_token_ids", f"must be non-negative integers, got {token!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    fail(name, f"must be >= 0, got {value}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def check_against_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in the vocabulary, logprob counts."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise InvalidRequestError(
                    f"{name} must be at most {max_logprobs} (the engine's max_logprobs), "
                    f"got {value}.",
                    name,
                )
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids: token id {token} is out of range [0, {vocab_size}).",
                    "stop_token_ids",
                )
        for token in self.logit_bias or {}:
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"logit_bias: token id {token} is out of range [0, {vocab_size}).",
                    "logit_bias",
                )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}.", name)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}.", name)


def _normalize_logit_bias(bias: Mapping[object, object]) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to biases.", "logit_bias")
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)  # JSON object keys arrive as strings
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}.", "logit_bias"
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise InvalidRequestError(
                f"logit_bias values must be numbers, got {value!r}.", "logit_bias"
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value}.",
                "logit_bias",
            )
        result[token] = float(value)
    return result
