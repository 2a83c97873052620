"""Sim stage: speculative decoding from an assumed acceptance rate.

The real Scheduler takes a Speculator (core/speculator_interface.py) and budgets, allocates and
updates verifications itself; the simulator hands it this one. It proposes k placeholder
tokens for every decode with room, k capped as NgramSpeculator caps it (the positions
max_model_len and max_tokens leave), and it stands in for the runner's verification:
each proposed token is accepted with probability A, independently, until the first
rejection, and the verification emits the accepted ones plus one more token. So a
verification of k proposals emits on average 1 + A + A^2 + ... + A^k tokens.

A is the chance that a proposal is accepted given the ones before it were (the alpha of
Leviathan et al.). The engine's reported acceptance rate, accepted / proposed, is lower
for k > 1 (a rejection ends the run): the expected_* figures convert one into the other.
Draws come from one seeded generator, in the scheduler's order, so a run repeats exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pagellm.errors import ConfigError
from pagellm.metrics.spec_decode_stats import SpecDecodeStats
from pagellm.request import Request


@dataclass(frozen=True)
class SimSpeculationConfig:
    num_speculative_tokens: int  # k, proposals per verification (fewer near a request's end)
    acceptance_rate: float  # A, per proposal given the earlier ones were accepted
    disable_by_batch_size: int | None = 8  # the engine's default; None: always speculate
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"--speculative-tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ConfigError(f"--spec-acceptance-rate must be in [0, 1], got {self.acceptance_rate}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(
                f"--spec-disable-by-batch-size must be at least 1 (0: never), got {self.disable_by_batch_size}"
            )

    @property
    def expected_accepted_per_verification(self) -> float:
        """Mean accepted tokens of a verification of all k proposals: A + A^2 + ... + A^k."""
        a = self.acceptance_rate
        return sum(a**i for i in range(1, self.num_speculative_tokens + 1))

    @property
    def expected_acceptance_rate(self) -> float:
        """accepted / proposed as the engine reports it, for verifications of all k."""
        return self.expected_accepted_per_verification / self.num_speculative_tokens

    @property
    def expected_mean_accepted_length(self) -> float:
        """Tokens emitted per verification of all k proposals."""
        return 1.0 + self.expected_accepted_per_verification

    def describe(self) -> dict[str, Any]:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "acceptance_rate_assumed": self.acceptance_rate,
            "disable_by_batch_size": self.disable_by_batch_size,
            "seed": self.seed,
            "expected_acceptance_rate": round(self.expected_acceptance_rate, 4),
            "expected_mean_accepted_length": round(self.expected_mean_accepted_length, 4),
        }


class SimSpeculator:
    """A Speculator for the real Scheduler, and the simulated runner's verification."""

    def __init__(self, config: SimSpeculationConfig, max_model_len: int, token_id: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.token_id = token_id  # what proposals and emitted tokens carry (only block hashes read it)
        self._rng = random.Random(config.seed)
        self._num_verifications = 0
        self._num_proposed = 0
        self._num_accepted = 0

    # The Speculator protocol (core/speculator_interface.py), called by the scheduler.

    def active(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, request: Request) -> list[int]:
        room = self.max_model_len - request.num_tokens
        if request.max_tokens is not None:
            # The verification emits up to k + 1 tokens: leave room for the last one.
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        k = min(self.config.num_speculative_tokens, room)
        return [self.token_id] * k if k > 0 else []

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self._num_verifications += 1
        self._num_proposed += num_proposed
        self._num_accepted += num_accepted

    def finished(self, request_id: str) -> None:
        pass  # nothing is kept per request: k is fixed and A is assumed, not estimated

    # The simulated runner's side.

    def verify(self, proposal: list[int]) -> list[int]:
        """The tokens a verification of `proposal` emits: its accepted prefix, then one."""
        rate = self.config.acceptance_rate
        num_accepted = 0
        while num_accepted < len(proposal) and self._rng.random() < rate:
            num_accepted += 1
        return proposal[:num_accepted] + [self.token_id]

    @property
    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self._num_verifications, self._num_proposed, self._num_accepted)
