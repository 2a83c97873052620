"""Metrics stage: speculative-decoding totals and the two figures people read from them.

Shared by the engine's offline snapshot (engine_metrics.py) and the simulator's report
(sim/), so that "acceptance rate" and "mean accepted length" mean the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecDecodeStats:
    """Verifications and their tokens (vLLM's names: num_drafts, num_draft_tokens,
    num_accepted_tokens). A verification is one request's proposal checked in one step;
    it emits its accepted tokens plus the model's own next one."""

    num_verifications: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    # Derived, but stored (not properties) so that dataclasses.asdict / JSON carry them.
    num_emitted_tokens: int = field(init=False)
    acceptance_rate: float | None = field(init=False)  # accepted / proposed; None: nothing proposed
    # Tokens emitted per verification, (accepted + verifications) / verifications: vLLM's
    # "mean acceptance length", between 1 and k + 1. None: no verification.
    mean_accepted_length: float | None = field(init=False)

    def __post_init__(self) -> None:
        emitted = self.num_accepted_tokens + self.num_verifications
        object.__setattr__(self, "num_emitted_tokens", emitted)
        object.__setattr__(
            self,
            "acceptance_rate",
            self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else None,
        )
        object.__setattr__(
            self, "mean_accepted_length", emitted / self.num_verifications if self.num_verifications else None
        )

    def __add__(self, other: SpecDecodeStats) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_verifications + other.num_verifications,
            self.num_proposed_tokens + other.num_proposed_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )

    def describe(self) -> str:
        """One line for logs and tables ("" when nothing was verified)."""
        if not self.num_verifications:
            return ""
        rate = "-" if self.acceptance_rate is None else f"{self.acceptance_rate:.1%}"
        return (
            f"acceptance rate {rate} ({self.num_accepted_tokens} of {self.num_proposed_tokens} "
            f"proposed tokens accepted), mean accepted length {self.mean_accepted_length:.2f} "
            f"tokens per verification ({self.num_verifications} verifications)"
        )
