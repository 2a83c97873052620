"""Core stage: prefill/decode balance: how many tokens a prefill may take.

A prefill is any request more than one token behind (a prompt, or a preempted request
recomputing its context); a decode is one token behind. The knobs live in
SchedulerConfig: max_num_partial_prefills, long_prefill_token_threshold, prefill_share.
"""

from __future__ import annotations

from pagellm.config import SchedulerConfig
from pagellm.request import Request


def prefill_token_cap(config: SchedulerConfig, token_budget: int, num_decodes: int) -> int:
    """Tokens prefill chunks may take in a step whose running set holds `num_decodes`
    decodes: prefill_share of the budget (at least one token, so prefills never starve).

    Every decode in a step waits for the whole step, so capping the prefill tokens that
    share a step with decodes caps the step's duration, which is the inter-token latency
    the decoding requests see. With no decode running, prefills take the whole budget.
    """
    if config.prefill_share >= 1.0 or num_decodes == 0:
        return token_budget
    return max(1, int(config.prefill_share * token_budget))


def prefill_chunk_size(
    config: SchedulerConfig, gap: int, token_budget: int, prefill_budget: int, num_prefills: int
) -> int:
    """Tokens of a prefill `gap` (> 1) to schedule now; 0 if the request must wait.

    num_prefills: requests already given prefill tokens in this step.
    """
    if config.max_num_partial_prefills is not None and num_prefills >= config.max_num_partial_prefills:
        return 0
    if not config.enable_chunked_prefill:
        return gap if gap <= token_budget else 0
    cap = min(token_budget, prefill_budget)
    if config.long_prefill_token_threshold is not None:
        cap = min(cap, config.long_prefill_token_threshold)
    return max(0, min(gap, cap))


def remaining_work(request: Request) -> int:
    """Tokens still to compute before the request can finish (at most)."""
    assert request.max_tokens is not None, "resolved when the request was added"
    return request.num_prompt_tokens + request.max_tokens - request.num_computed_tokens
