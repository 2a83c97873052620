"""Core stage: multi-step decoding (--num-scheduler-steps N): when a step may compute
several tokens of a decoding request, and how many.

While every running request decodes and none waits, the scheduler gives each decode up
to N positions at once: the runner computes the request's last token, samples the next,
feeds it back, N times in one call (each sample through the same sampler, penalties,
seeds and logprobs as N separate steps would take). The engine's per-step Python
(scheduling, output processing, stats, metrics) then runs once per N tokens, which on a
CPU decoding one stream is a sixth of the time of a token.

The scheduler checks stops afterwards, token by token, exactly as for N steps: a request
that stops at its j-th token keeps j tokens and its positions beyond are wasted work (at
most N - 1 forwards of one row). A waiting request blocks multi-step (it would wait N
steps for its prefill), as does anything a single step must see: a structured-output
grammar (its matcher must refuse a token before the next is drawn), a pooled request,
an n > 1 request that has not forked.
"""

from __future__ import annotations

from pagellm.request import Request


def can_run_several(request: Request) -> bool:
    """Whether a decoding request may compute several positions in one step."""
    return (
        not request.is_pooling
        and request.sampling_params.structured_outputs is None
        and request.num_pending_forks == 0
        and request.num_tokens - request.num_computed_tokens == 1
    )


def decode_steps(request: Request, num_scheduler_steps: int, max_model_len: int) -> int:
    """Positions a decode computes this step: at most `num_scheduler_steps`, and never
    past the tokens it may still emit (max_tokens) or the context (max_model_len), so no
    block is allocated for a position it could never reach."""
    left = max_model_len - request.num_tokens
    if request.max_tokens is not None:
        left = min(left, request.max_tokens - request.num_output_tokens)
    return max(1, min(num_scheduler_steps, left))
