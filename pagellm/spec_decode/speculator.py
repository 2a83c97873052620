"""Spec decode stage: which decodes speculate this step, and what they propose.

The scheduler (pure Python) asks this object for each running decode's proposal. A step
speculates only while at most `disable_by_batch_size` requests run: a larger decode batch
is compute-bound, and verifying k proposed tokens then costs about k times the work it
might save. Each request then proposes as many tokens as its recent acceptance and the
measured cost of a verified position make worth it (policy.py), none when its proposals
have lately been poor. A request that does not propose still has its would-be proposal
checked against the token it goes on to produce (free for prompt lookup), so it starts
again when its text turns to quoting. Any request speculates except one with an output
constraint (its grammar would have to follow each draft): the runner verifies greedy
ones by argmax and others by rejection sampling, exact either way. A seeded request's
proposal length depends on its tokens only (the prior position cost, not the measured
one), so that its draws, and so its text, are the same from run to run. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.config import SpeculativeConfig
from pagellm.core.scheduler_output import DRAFT_PLACEHOLDER
from pagellm.request import Request
from pagellm.spec_decode.ngram_proposer import propose_ngram
from pagellm.spec_decode.policy import AcceptanceEstimate, StepCost, best_num_tokens


@dataclass
class SpeculationStats:
    num_proposed: int = 0
    num_accepted: int = 0
    num_verifications: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_proposed if self.num_proposed else None


@dataclass
class _RequestSpeculation:
    acceptance: AcceptanceEstimate
    # A proposal made but not verified (the policy chose 0): checked against the tokens
    # the request produces next. (position of its first token, tokens)
    shadow: tuple[int, list[int]] | None = None
    declined: int = 0  # decodes in a row without a proposal (draft models probe after a while)


class _Speculator:
    """What both proposal methods share: eligibility, room, the policy, the counts."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()
        self.step_cost = StepCost()
        self._requests: dict[str, _RequestSpeculation] = {}
        self._taken = (0, 0, 0)

    def active(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, request: Request) -> list[int]:
        params = request.sampling_params
        if params.structured_outputs is not None:
            return []
        room = self.max_model_len - request.num_tokens  # positions the cache may still hold
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        k = min(self.config.num_speculative_tokens, room)
        if k <= 0:
            return []
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestSpeculation(AcceptanceEstimate())
        ratio = self.step_cost.prior_ratio if params.seed is not None else self.step_cost.ratio
        return self._proposal(request, state, k, ratio)

    def _proposal(self, request: Request, state: _RequestSpeculation, k: int, ratio: float) -> list[int]:
        raise NotImplementedError

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self.stats.num_proposed += num_proposed
        self.stats.num_accepted += num_accepted
        self.stats.num_verifications += 1
        state = self._requests.get(request.request_id)
        if state is not None:
            state.acceptance.update(num_accepted, was_rejected=num_accepted < num_proposed)

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def observe_step(self, num_positions: int, seconds: float) -> None:
        """A step's size (positions computed) and duration, for the cost estimate. With
        a draft model the draft's forwards are part of the step: its cost per proposed
        token is in the fitted cost of a position."""
        self.step_cost.observe(num_positions, seconds)

    def take_new(self) -> tuple[int, int, int]:
        """(verifications, proposed, accepted) since the last call, for the metrics."""
        stats, last = self.stats, self._taken
        new = (stats.num_verifications - last[0], stats.num_proposed - last[1], stats.num_accepted - last[2])
        self._taken = (stats.num_verifications, stats.num_proposed, stats.num_accepted)
        return new


class NgramSpeculator(_Speculator):
    def _proposal(self, request: Request, state: _RequestSpeculation, k: int, ratio: float) -> list[int]:
        tokens = request.all_token_ids
        if state.shadow is not None:
            self._check_shadow(state, tokens)
        proposal = propose_ngram(tokens, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        if not proposal:
            return []
        wanted = best_num_tokens(state.acceptance.rate, ratio, len(proposal))
        if wanted == 0:
            state.shadow = (len(tokens), proposal)
        return proposal[:wanted]

    @staticmethod
    def _check_shadow(state: _RequestSpeculation, tokens: list[int]) -> None:
        """Score an unverified proposal against the tokens produced since it was made."""
        assert state.shadow is not None
        position, proposal = state.shadow
        state.shadow = None
        produced = tokens[position : position + len(proposal)]
        matched = 0
        while matched < len(produced) and produced[matched] == proposal[matched]:
            matched += 1
        if produced:
            state.acceptance.update(matched, was_rejected=matched < len(produced))


# A request whose draft proposals stopped paying proposes one token again after this many
# decodes without (a draft's proposal costs a forward to know, unlike a lookup's).
DRAFT_PROBE_INTERVAL = 16


class DraftModelSpeculator(_Speculator):
    """Proposals are k placeholders: the runner's draft model decides the tokens in the
    same step (spec_decode/draft_model.py), and the runner reports them back."""

    def _proposal(self, request: Request, state: _RequestSpeculation, k: int, ratio: float) -> list[int]:
        wanted = best_num_tokens(state.acceptance.rate, ratio, k)
        if wanted == 0:
            state.declined += 1
            if state.declined < DRAFT_PROBE_INTERVAL:
                return []
            wanted = 1
        state.declined = 0
        return [DRAFT_PLACEHOLDER] * wanted


def make_speculator(config: SpeculativeConfig, max_model_len: int) -> _Speculator:
    if config.method == "draft_model":
        return DraftModelSpeculator(config, max_model_len)
    return NgramSpeculator(config, max_model_len)
