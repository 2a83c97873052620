"""Core stage: one schedule() call's plan so far: the budgets left and what is scheduled."""

from __future__ import annotations

import dataclasses

from pagellm.core.kv_tier_access import TierLoad
from pagellm.request import Request


@dataclasses.dataclass
class StepPlan:
    """What one schedule() call has decided so far."""

    token_budget: int
    prefill_budget: int  # tokens prefill chunks may still take (see prefill_token_cap)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    prefill_req_ids: set[str] = dataclasses.field(default_factory=set)
    new_block_ids: dict[str, list[list[int]]] = dataclasses.field(default_factory=dict)  # per KV cache group
    # Requests the runner holds no state for: admitted or swapped in this step.
    resumed_req_ids: set[str] = dataclasses.field(default_factory=set)
    preempted_req_ids: set[str] = dataclasses.field(default_factory=set)
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Speculative decoding: proposals to verify, per scheduled request.
    spec_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    speculate: bool = False  # proposals are asked for in this step
    # Multi-step decoding: decodes may take several positions (core/multi_step.py).
    multi_step: bool = False
    decode_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    # An interactive request waits or prefills: background work sits this step out, so the
    # step (and that request's first token) is as fast as without it.
    pause_background: bool | None = None  # None: not decided yet (Scheduler._pauses_background)
    background_budget: int | None = None  # tokens background requests may still take (None: any)
    # The prefix cache's tier: requests admitted to load their prefix this step.
    loading: dict[str, TierLoad] = dataclasses.field(default_factory=dict)
    # LoRA: the adapters of the requests scheduled so far, each with its request count.
    adapters: dict[int, int] = dataclasses.field(default_factory=dict)

    def has_adapter_room(self, request: Request, max_loras: int | None) -> bool:
        """Whether the request's adapter is in the step already or one more fits (the base
        model takes no slot; max_loras None: no cap)."""
        lora_id = request.lora_int_id
        return max_loras is None or lora_id == 0 or lora_id in self.adapters or len(self.adapters) < max_loras

    def schedule(self, request: Request, num_tokens: int, block_ids: list[list[int]], is_prefill: bool) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_block_ids[request.request_id] = block_ids
        self.token_budget -= num_tokens
        if request.lora_int_id:
            self.adapters[request.lora_int_id] = self.adapters.get(request.lora_int_id, 0) + 1
        if request.background and self.background_budget is not None:
            self.background_budget -= num_tokens
        if is_prefill:
            self.prefill_req_ids.add(request.request_id)
            self.prefill_budget -= num_tokens

    def unschedule(self, request: Request) -> None:
        """Give back the budget of a request preempted after it was scheduled."""
        if request.request_id in self.num_scheduled_tokens and request.lora_int_id:
            left = self.adapters.pop(request.lora_int_id) - 1
            if left:
                self.adapters[request.lora_int_id] = left
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, 0)
        self.new_block_ids.pop(request.request_id, None)
        self.spec_tokens.pop(request.request_id, None)
        self.token_budget += num_tokens
        if request.background and self.background_budget is not None:
            self.background_budget += num_tokens
        if request.request_id in self.prefill_req_ids:
            self.prefill_req_ids.discard(request.request_id)
            self.prefill_budget += num_tokens
