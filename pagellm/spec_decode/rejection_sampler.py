"""Spec decode stage: verify proposed tokens against the target model, exactly in
distribution (the rejection sampling of Leviathan et al. and Chen et al., 2023).

For each request, draft token x_j (proposed with probability q_j(x_j); 1 for n-gram
proposals, a point mass) is accepted with probability min(1, p_j(x_j) / q_j(x_j)), where
p_j is the target's distribution at that position after temperature, top-k/top-p and
penalties. At the first rejection, one token is drawn from the residual
max(p_j - q_j, 0), renormalized, and the rest of the proposal is dropped; when every
draft is accepted, a bonus token is drawn from p at the position after the last one.
Each step thus emits between 1 and k + 1 tokens, and their distribution is exactly the
target's, whatever the proposals. Greedy requests accept a draft iff it is the target's
argmax, and emit the argmax at the first mismatch: exactly the tokens of plain greedy
decoding.

Vectorized over requests: the positions are a short loop, the requests a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.sample.argmax import row_argmax


@dataclass(frozen=True)
class VerifiedTokens:
    token_ids: list[list[int]]  # per request, the emitted tokens (accepted drafts, then one more)
    num_accepted: list[int]  # per request, how many drafts were accepted


def rejection_sample(
    target_probs: torch.Tensor,  # [num_requests, max_drafts + 1, vocab], rows sum to 1
    draft_token_ids: torch.Tensor,  # [num_requests, max_drafts] int64 (padding: any id)
    num_drafts: torch.Tensor,  # [num_requests] int64, each <= max_drafts
    draft_probs: torch.Tensor | None = None,  # [num_requests, max_drafts, vocab]; None: point masses
    generator: torch.Generator | None = None,
) -> VerifiedTokens:
    num_requests, positions, vocab = target_probs.shape
    max_drafts = positions - 1
    device = target_probs.device
    if max_drafts == 0:
        final = torch.multinomial(target_probs[:, 0], 1, generator=generator).squeeze(1).tolist()
        return VerifiedTokens([[token] for token in final], [0] * num_requests)
    rows = torch.arange(num_requests, device=device)
    steps = torch.arange(max_drafts, device=device)
    in_range = steps.unsqueeze(0) < num_drafts.unsqueeze(1)  # [n, max_drafts]
    drafts = draft_token_ids.clamp(0, vocab - 1)
    p_draft = target_probs[:, :max_drafts].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [n, max_drafts]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(-1)).squeeze(-1)
    uniform = torch.rand(num_requests, max_drafts, device=device, generator=generator, dtype=target_probs.dtype)
    # u < p/q, written as u * q < p so that q = 0 (never proposed) rejects.
    accepted = (uniform * q_draft < p_draft) & in_range
    # The first rejection (or num_drafts when all were accepted).
    rejected_at = torch.where(~accepted & in_range, steps.unsqueeze(0), max_drafts).amin(dim=1)
    first_out = torch.minimum(rejected_at, num_drafts)
    all_accepted = first_out == num_drafts
    # The last token: from the residual at the rejection, or from p after the last draft.
    final_p = target_probs[rows, first_out]  # [n, vocab]
    if max_drafts:
        at = first_out.clamp(max=max_drafts - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(final_p).scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
        else:
            q_at = draft_probs[rows, at]
        residual = (final_p - q_at).clamp_min(0.0)
        final_p = torch.where(all_accepted.unsqueeze(1), final_p, residual)
    final = torch.multinomial(final_p / final_p.sum(dim=1, keepdim=True), 1, generator=generator).squeeze(1)
    counts = first_out.tolist()
    kept = drafts.tolist()
    last = final.tolist()
    return VerifiedTokens([kept[i][: counts[i]] + [last[i]] for i in range(num_requests)], counts)


def greedy_verify(
    target_logits: torch.Tensor,  # [num_requests, max_drafts + 1, vocab]
    draft_token_ids: torch.Tensor,  # [num_requests, max_drafts]
    num_drafts: torch.Tensor,  # [num_requests]
) -> VerifiedTokens:
    """Accept drafts while they are the target's argmax; then the argmax."""
    # float32 first: the CPU argmax of bf16 is torch's (row_argmax), several times slower.
    best = row_argmax(target_logits.float())  # [n, max_drafts + 1]
    max_drafts = draft_token_ids.shape[1]
    if max_drafts == 0:
        return VerifiedTokens([[token] for token in best[:, 0].tolist()], [0] * best.shape[0])
    steps = torch.arange(max_drafts, device=best.device)
    in_range = steps.unsqueeze(0) < num_drafts.unsqueeze(1)
    matches = (best[:, :max_drafts] == draft_token_ids) & in_range
    mismatch_at = torch.where(~matches & in_range, steps.unsqueeze(0), max_drafts).amin(dim=1)
    counts = torch.minimum(mismatch_at, num_drafts).tolist()
    best_list = best.tolist()
    return VerifiedTokens([best_list[i][: counts[i] + 1] for i in range(len(counts))], counts)
