"""Spec decode stage: how many tokens a request should propose this step.

Verifying k proposed tokens makes a step compute k more positions. Where a step's cost
is reading the weights (a GPU, a small batch) the extra positions are nearly free; where
arithmetic already matters (a CPU: on a 2-core machine one more position costs about a
third of a whole decode step) they are worth it only when they are likely accepted.

Two estimates, both measured while the engine runs:

- StepCost: step seconds = fixed + per_position * positions, fitted over recent small
  steps (exponentially weighted least squares). Its `ratio` is what one more position
  costs against a one-position step.
- AcceptanceEstimate, per request: the chance that a proposed token is accepted given
  that the ones before it were (accepted tokens over accepted tokens plus rejections,
  recent verifications weighing more). Proposals stop at the first rejection, so this
  is the estimate of a geometric acceptance model.

With acceptance a, k proposals emit 1 + a + ... + a^k tokens for a step costing
1 + ratio * k; `best_num_tokens` takes the k that maximises tokens per cost (0: do not
speculate). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

# Until there is evidence: proposals are assumed mostly right (so that a request starts
# out speculating and measures its own rate), and a position costs a fifth of a step.
PRIOR_ACCEPTANCE = 0.8
PRIOR_WEIGHT = 2.0  # in verifications' worth of evidence
PRIOR_RATIO = 0.2
# Evidence older than ~5 verifications fades: acceptance changes along a text (a quoted
# passage, then free writing).
EVIDENCE_DECAY = 0.8
# Steps of more positions than this are not decode-sized: left out of the fit.
MAX_FIT_POSITIONS = 64


@dataclass
class AcceptanceEstimate:
    # Decayed counts, starting from the prior's pseudo-counts (which fade like evidence).
    accepted: float = PRIOR_WEIGHT * PRIOR_ACCEPTANCE
    rejected: float = PRIOR_WEIGHT * (1.0 - PRIOR_ACCEPTANCE)

    def update(self, num_accepted: int, was_rejected: bool) -> None:
        self.accepted = self.accepted * EVIDENCE_DECAY + num_accepted
        self.rejected = self.rejected * EVIDENCE_DECAY + (1.0 if was_rejected else 0.0)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class StepCost:
    """Exponentially weighted least-squares fit of step time against positions computed."""

    def __init__(self, decay: float = 0.98, prior_ratio: float = PRIOR_RATIO) -> None:
        self.decay = decay
        self.prior_ratio = prior_ratio
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_positions: int, seconds: float) -> None:
        if num_positions < 1 or num_positions > MAX_FIT_POSITIONS or seconds <= 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + num_positions
        self._y = self._y * d + seconds
        self._xx = self._xx * d + num_positions * num_positions
        self._xy = self._xy * d + num_positions * seconds

    @property
    def ratio(self) -> float:
        """Cost of one more position over the cost of a one-position step."""
        if self._w < 4:
            return self.prior_ratio
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < 0.25:  # all steps about the same size: the slope is not measured
            return self.prior_ratio
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        one_position = mean_y + slope * (1 - mean_x)
        if one_position <= 0:
            return self.prior_ratio
        return min(max(slope / one_position, 0.0), 2.0)


def best_num_tokens(acceptance: float, ratio: float, max_tokens: int) -> int:
    """Proposal length in [0, max_tokens] with the most expected tokens per step cost."""
    best_k, best_rate = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, max_tokens + 1):
        term *= acceptance
        expected += term
        rate = expected / (1.0 + ratio * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
