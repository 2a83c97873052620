"""Core stage: parallel sampling (n > 1) as completions forked from one request.

The request is completion 0. When its prompt is computed, the runner samples n first
tokens from the prompt's last logits; the scheduler then forks completions 1..n-1,
which share the prompt's KV blocks (KVCacheManager.fork) and go on as requests of their
own. The prompt is computed once, whatever n is.
"""

from __future__ import annotations

import dataclasses

from pagellm.request import Request, RequestStatus, child_request_id


def make_child_request(parent: Request, completion_index: int) -> Request:
    """Completion `completion_index` of `parent`, its prompt already computed."""
    child = Request(
        child_request_id(parent.request_id, completion_index),
        parent.prompt_token_ids,
        dataclasses.replace(parent.sampling_params, n=1),
        eos_token_ids=parent.eos_token_ids,
        arrival_time=parent.arrival_time,
        priority=parent.priority,
        background=parent.background,
        max_tokens=parent.max_tokens,
        lora_request=parent.lora_request,
    )
    child.parent_request_id = parent.request_id
    child.completion_index = completion_index
    child.num_computed_tokens = parent.num_prompt_tokens
    child.status = RequestStatus.RUNNING
    return child
