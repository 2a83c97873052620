"""Spec decode stage: a draft model proposes the tokens the target then verifies.

Each step, before the target's forward, the draft runs for the requests that speculate:
one batched forward over the tokens it has not seen yet (its catch-up: at first the
request's whole prompt and output, later the one to k + 1 tokens the last verification
emitted), whose last row gives the first draft token, then k - 1 batched one-token
forwards, each feeding the previous draft token. Greedy requests take the draft's
argmax; sampled ones draw from the draft's own distribution after the same processing
as the target's (`choose`, supplied by the runner), which rejection sampling needs (q).

Its KV cache is its own tensors addressed by the target's block tables (same block ids,
same block size): the positions the draft writes (up to the last draft token's) are
slots the scheduler allocated for the verification. A request's draft K/V is trusted
only from what this object computed for it since the runner (re)added the request: a
recomputed, swapped-in or forked request catches up from position 0, and blocks that
other requests share (prefix hits) are only ever written with the K/V of the same
tokens. So nothing of the block manager changes for the draft; cache sizing counts its
bytes per block beside the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagellm.worker.kv_cache import allocate_kv_caches
from pagellm.worker.model_inputs import ScheduledSequence
from pagellm.worker.step_paths import StepInputs, StepPaths

# (request id, drafts so far, the draft's logits at the next position) -> (the next draft
# token, the distribution it was drawn from; None: a point mass, i.e. greedy).
ChooseDraft = Callable[[str, list[int], torch.Tensor], tuple[int, torch.Tensor | None]]


@dataclass(frozen=True)
class DraftWork:
    """One speculating request's share of a step."""

    req_id: str
    token_ids: list[int]  # prompt + output so far (the runner's copy)
    block_ids: list[int]  # covers the verification's positions (the target's one KV cache group)
    num_tokens: int  # len(token_ids): the first draft token goes at this position
    num_drafts: int  # k


@dataclass
class Drafts:
    token_ids: list[int]
    probs: list[torch.Tensor] | None  # per draft token, the draft's distribution (None: greedy)


class DraftModelProposer:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, kv_cache_dtype, device)
        self.step_paths = StepPaths.for_model(model)  # the draft's steps run as the target's do
        self.computed: dict[str, int] = {}  # request -> positions whose draft K/V is valid

    def drop(self, req_id: str) -> None:
        self.computed.pop(req_id, None)

    def propose(self, work: list[DraftWork], choose: ChooseDraft) -> dict[str, Drafts]:
        """k draft tokens for each request of `work`, in 1 + (max k - 1) forwards."""
        sequences = []
        for item in work:
            start = self.computed.get(item.req_id, 0)
            sequences.append(ScheduledSequence(item.token_ids[start : item.num_tokens], start, [item.block_ids], True))
        logits = self._forward(sequences)
        drafts = {item.req_id: Drafts([], None) for item in work}
        self._choose(work, logits, drafts, choose)
        for item in work:
            self.computed[item.req_id] = item.num_tokens
        for step in range(1, max(item.num_drafts for item in work)):
            active = [item for item in work if item.num_drafts > step]
            sequences = [
                ScheduledSequence(
                    [drafts[item.req_id].token_ids[-1]], item.num_tokens + step - 1, [item.block_ids], True
                )
                for item in active
            ]
            self._choose(active, self._forward(sequences), drafts, choose)
        return drafts

    def verified(self, req_id: str, num_tokens: int, num_drafts: int, num_accepted: int) -> None:
        """After verification: the draft's K/V is valid up to the last accepted draft it
        was fed (it wrote drafts 1..k-1 at positions num_tokens .. num_tokens + k - 2)."""
        self.computed[req_id] = num_tokens + min(num_accepted, num_drafts - 1)

    def _forward(self, sequences: list[ScheduledSequence]) -> torch.Tensor:  # [requests, vocab]
        step = StepInputs(sequences, self.kv_caches, self.block_size, self.device)
        hidden = self.step_paths.forward(step)
        return self.model.compute_logits(hidden[step.model_inputs.logits_indices])

    @staticmethod
    def _choose(work: list[DraftWork], logits: torch.Tensor, drafts: dict[str, Drafts], choose: ChooseDraft) -> None:
        for row, item in enumerate(work):
            result = drafts[item.req_id]
            token, probs = choose(item.req_id, result.token_ids, logits[row])
            result.token_ids.append(token)
            if probs is not None:  # a request draws every draft token, or none (greedy)
                result.probs = [*(result.probs or []), probs]
