"""Core stage: bringing requests into a step: swapped-out ones back first, then waiting
ones from the head of the queue (a base-model request may pass a head that waits for an
adapter slot; an interactive one preempts background work to fit), each admitted with its
prefix-cache hit, or to load its prefix from the tier in this step and compute from the next.

A mixin of Scheduler (core/scheduler.py), which owns the queues and the KV cache manager and
decides the step's budget (_num_tokens_to_schedule), when background work pauses
(_pauses_background) and whom to preempt (_preempt_background).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.core.kv_cache_records import NO_HIT, ComputedBlocks
from pagellm.core.step_plan import StepPlan
from pagellm.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagellm.config import SchedulerConfig
    from pagellm.core.kv_cache_manager import KVCacheManager
    from pagellm.core.request_queue import RequestQueue


class StepAdmission:
    """_schedule_swapped, _schedule_waiting and admission, on Scheduler's state (declared
    here for readers)."""

    scheduler_config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    running: list[Request]
    waiting: RequestQueue
    swapped: RequestQueue

    def _has_room_for(self, request: Request, plan: StepPlan) -> bool:
        # An n > 1 request reserves seats for the completions it will fork, so that
        # forking never pushes the running set past max_num_seqs.
        # Running parents that have not forked yet hold their children's seats too.
        taken = len(self.running) + sum(r.num_pending_forks for r in self.running)
        seats = 1 + request.num_pending_forks
        return plan.token_budget > 0 and taken + seats <= self.scheduler_config.max_num_seqs

    def _schedule_swapped(self, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        while self.swapped:
            request = self.swapped.peek()
            if request.background and self._pauses_background(plan):
                break  # it would only be preempted again, or slow an interactive prefill
            if not self._has_room_for(request, plan):
                break
            gap = request.num_tokens - request.num_computed_tokens
            num_tokens = self._num_tokens_to_schedule(gap, plan, request)
            if num_tokens == 0 or not kv.can_swap_in(request, num_tokens):
                break
            pairs = kv.swap_in(request)
            block_ids = kv.allocate_slots(request, num_tokens)
            assert pairs is not None and block_ids is not None, "can_swap_in promised room"
            self.swapped.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.blocks_to_swap_in.extend(pairs)
            plan.resumed_req_ids.add(request.request_id)
            plan.schedule(request, num_tokens, block_ids, is_prefill=gap > 1)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        while self.waiting:
            request = self.waiting.peek()
            if request.background and (self.swapped or self._pauses_background(plan)):
                break  # swapped-out background work goes first; none while interactive work prefills
            if self._admit(request, plan):
                continue
            if not plan.has_adapter_room(request, self.scheduler_config.max_loras):
                self._admit_base_model_behind(request, plan)
                break
            # An interactive request does not wait for background work: preempt it (the
            # latest admitted first) until the request fits, or none is left.
            if request.background or not self._preempt_background(plan):
                break

    def _admit_base_model_behind(self, head: Request, plan: StepPlan) -> None:
        """The head waits for a slot for its adapter: base-model requests behind it may
        pass it (they take no slot, so the head's turn comes no later), in queue order
        while they fit. Requests of adapters never pass it: they would keep their adapter
        in the step's slots and could starve the head's."""
        for request in list(self.waiting):
            if request is head or request.lora_int_id or request.background:
                continue
            if not self._admit(request, plan):
                return

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Admit a waiting request (the head, or one allowed to pass it) if it fits this step."""
        kv = self.kv_cache_manager
        if not self._has_room_for(request, plan):
            return False
        assert request.num_computed_tokens == 0
        pooling = request.pooling_params
        if request.sampling_params.prompt_logprobs is None and (pooling is None or not pooling.needs_every_position):
            computed = kv.get_computed_blocks(request)
        else:
            # Prompt logprobs need the logits of every prompt position, mean or CLS
            # pooling their hidden states.
            computed = NO_HIT
        if computed.tier_digests or computed.state_key is not None:
            return self._admit_loading(request, plan, computed)
        gap = request.num_tokens - computed.num_computed_tokens
        num_tokens = self._num_tokens_to_schedule(gap, plan, request)
        if num_tokens == 0:
            return False  # head-of-line: later requests must not overtake it
        block_ids = kv.allocate_slots(request, num_tokens, computed)
        if block_ids is None:
            return False
        kv.count_tier_lookup(computed)
        self.waiting.remove(request)
        request.num_computed_tokens = computed.num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = computed.num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.resumed_req_ids.add(request.request_id)
        plan.schedule(request, num_tokens, block_ids, is_prefill=gap > 1)
        return True

    def _admit_loading(self, request: Request, plan: StepPlan, computed: ComputedBlocks) -> bool:
        """Admit a request whose prefix continues in the tier: this step loads it (beside
        the others' compute), and it computes from the next step on, from the end of what
        loaded correctly (see StepAccounting._finish_loads)."""
        if request.background and self._pauses_background(plan):
            return False
        load = self.kv_cache_manager.allocate_for_load(request, computed)
        if load is None:
            return False
        self.waiting.remove(request)
        request.num_computed_tokens = computed.num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.loading[request.request_id] = load
        return True


__all__ = ["StepAdmission"]
