"""Worker stage: speculative decoding's share of a step in the runner: the draft
model's proposals before the forward, and the verification of every proposal from the
logits of its k + 1 positions after it (argmax for plain greedy requests, rejection
sampling against each position's sampling distribution for the others).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from pagellm.core.scheduler_output import ModelRunnerOutput
from pagellm.sample.argmax import row_argmax
from pagellm.sample.penalties import PenaltyState
from pagellm.sample.sampler import Sampler, SamplingBatch, gather_logprobs, held_back_ids
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.draft_model import DraftModelProposer, Drafts, DraftWork
from pagellm.spec_decode.rejection_sampler import greedy_verify, rejection_sample
from pagellm.worker.request_state import RunnerRequestState


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits: verified by argmax alone."""
    return params.is_greedy and not (params.has_penalties or params.logit_bias or params.min_tokens)


class SpeculativeVerifier:
    """Drafts and verifies for one ModelRunner.

    It is handed the runner's parts it reads (its request states, which it extends with
    the emitted tokens, the sampler, penalties and seeded generators) rather than the
    runner, and the draft model with each call, since the worker attaches that after
    the runner is built."""

    def __init__(
        self,
        *,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],  # hidden rows -> their logits
        requests: Mapping[str, RunnerRequestState],
        sampler: Sampler,
        penalties: PenaltyState,
        generators: Mapping[str, torch.Generator],
        device: torch.device,
        is_driver: bool,
    ) -> None:
        self.compute_logits = compute_logits
        self.requests = requests
        self.sampler = sampler
        self.penalties = penalties
        self.generators = generators
        self.device = device
        # Only the driver samples; the other tensor-parallel ranks make the logits call
        # (a collective) and stop there.
        self.is_driver = is_driver

    def verify(
        self,
        req_ids: list[str],
        proposals: dict[str, list[int]],
        starts: list[int],
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
        drafts: dict[str, Drafts],
        draft_model: DraftModelProposer | None,
    ) -> None:
        """Verify each speculating request's proposal from its k + 1 rows' logits.

        Plain greedy requests keep the drafts while they are the argmax, then the argmax.
        Every other request goes through rejection sampling against the distribution its
        token would be drawn from at each position (penalties, bias, held-back tokens,
        temperature, top-k/top-p/min-p, with the drafts before the position counted as
        output), so the emitted tokens follow exactly that distribution; a seeded request
        draws from its own generator. A draft model's tokens drawn from its own
        distribution q are accepted with min(1, p/q); greedy ones are point masses."""
        spans = [(req_id, starts[i], starts[i + 1]) for i, req_id in enumerate(req_ids) if req_id in proposals]
        index = torch.tensor([row for _, first, end in spans for row in range(first, end)], device=self.device)
        logits = self.compute_logits(hidden[index])  # every rank: a collective under TP
        if not self.is_driver:
            return
        offset = 0
        for req_id, first, end in spans:
            proposal = proposals[req_id]
            rows = logits[offset : offset + end - first]
            offset += end - first
            state = self.requests[req_id]
            params = state.sampling_params
            draft_ids = torch.tensor([proposal], device=rows.device)
            num_drafts = torch.tensor([len(proposal)], device=rows.device)
            raw_logprobs = rows.float().log_softmax(dim=-1) if params.logprobs is not None else None
            drafted = drafts.get(req_id)
            draft_probs = None
            if drafted is not None and drafted.probs is not None:
                draft_probs = torch.stack(drafted.probs).unsqueeze(0)
            if plain_greedy(params):
                verified = greedy_verify(rows.unsqueeze(0), draft_ids, num_drafts)
            else:
                probs = self.sampler.target_probs(rows, self._batch(req_id, proposal))
                verified = rejection_sample(
                    probs.unsqueeze(0), draft_ids, num_drafts, draft_probs, generator=self.generators.get(req_id)
                )
            emitted = verified.token_ids[0]
            if drafted is not None:
                assert draft_model is not None
                draft_model.verified(req_id, len(state.token_ids), len(proposal), verified.num_accepted[0])
                output.drafted_token_ids[req_id] = proposal
            if raw_logprobs is not None:
                if output.logprobs is None:
                    output.logprobs = {}
                chosen = torch.tensor(emitted, device=rows.device)
                output.logprobs[req_id] = gather_logprobs(raw_logprobs[: len(emitted)], chosen, [params] * len(emitted))
            state.token_ids.extend(emitted)
            self.penalties.record([req_id] * len(emitted), emitted)
            output.sampled_token_ids[req_id] = emitted

    def _batch(self, req_id: str, drafts: list[int], first: int = 0) -> SamplingBatch:
        """Sampling settings of positions first..len(drafts) of a proposal: position j
        comes after the request's tokens and drafts[:j] (for min_tokens and the
        penalties' counts)."""
        state = self.requests[req_id]
        params = state.sampling_params
        penalties = self.penalties
        positions = range(first, len(drafts) + 1)
        held_back = held_back_ids(params, state.eos_token_ids)
        banned = [held_back if state.num_output_tokens + j < params.min_tokens else [] for j in positions]
        batch = SamplingBatch(params=[params] * len(positions), generators=[None] * len(positions), banned_token_ids=banned)
        if penalties.has(req_id):
            row = penalties.rows_of([req_id])
            counts = penalties.output_counts[row].repeat(len(positions), 1)
            for i, j in enumerate(positions):
                for token in drafts[:j]:
                    counts[i, token] += 1
            batch.penalty_rows = list(range(len(positions)))
            batch.output_counts = counts
            batch.prompt_mask = penalties.prompt_mask[row].repeat(len(positions), 1)
        return batch

    # ---------------------------------------------------------- draft model

    def draft(self, proposals: dict[str, list[int]], draft_model: DraftModelProposer) -> dict[str, Drafts]:
        """The draft model's tokens for the scheduled placeholders."""
        work = []
        for req_id, placeholders in proposals.items():
            state = self.requests[req_id]
            work.append(DraftWork(req_id, state.token_ids, state.block_ids[0], len(state.token_ids), len(placeholders)))
        return draft_model.propose(work, self._choose_draft)

    def _choose_draft(self, req_id: str, drafts: list[int], logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft's next token: its argmax for greedy requests, else a draw from its
        distribution after the request's processing (returned: rejection sampling needs it)."""
        params = self.requests[req_id].sampling_params
        if plain_greedy(params):
            return int(row_argmax(logits.float())), None
        probs = self.sampler.target_probs(logits.unsqueeze(0), self._batch(req_id, drafts, len(drafts)))[0]
        if params.is_greedy:
            return int(probs.argmax()), None
        token = torch.multinomial(probs, 1, generator=self.generators.get(req_id))
        return int(token), probs
