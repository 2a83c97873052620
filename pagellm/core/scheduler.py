"""Core stage: continuous-batching scheduler: what runs each step, how many tokens.

Every request has num_computed_tokens; each step tops requests up toward their token
count within a token budget (max_num_batched_tokens) and a cap on running requests
(max_num_seqs). Running requests are served first, in admission order (closest to
finishing first under "shortest-remaining"); then swapped requests are brought back;
then waiting requests are admitted. When a running request cannot get blocks, another
one is preempted (recompute or swap). Prefill chunks are bounded by the balance knobs
of SchedulerConfig (core/prefill_balance.py). Bringing swapped and waiting requests in is
core/step_admission.py; accounting for an executed step, core/step_accounting.py.

num_computed_tokens is advanced in update_from_output, once the runner has executed
the step: it always means "KV written in the cache". Between schedule() and
update_from_output() it still holds the value the runner was told.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.kv_tier_access import TierLoad
from pagellm.core.multi_step import can_run_several, decode_steps
from pagellm.core.prefill_balance import prefill_chunk_size, prefill_token_cap, remaining_work
from pagellm.core.scheduler_integrity import check_scheduler_integrity
from pagellm.core.scheduler_stats import FinishedRequestStats, SchedulerStats, by_adapter, kv_cache_fields
from pagellm.core.speculator_interface import Speculator
from pagellm.core.step_accounting import StepAccounting
from pagellm.core.step_admission import StepAdmission
from pagellm.core.step_plan import StepPlan
from pagellm.core.admission import check_request_fits
from pagellm.core.request_queue import RequestQueue
from pagellm.core.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from pagellm.errors import InvalidRequestError
from pagellm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler(StepAccounting, StepAdmission):
    """Owns every unfinished request and the KV cache manager. schedule() decides a
    step; update_from_output (core/step_accounting.py) accounts for it once it ran."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, speculator: Speculator | None = None
    ) -> None:
        self.scheduler_config = scheduler_config
        self.speculator = speculator
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(cache_config, self.max_model_len)

        self.requests: dict[str, Request] = {}
        self._arrival_index: dict[str, int] = {}
        self._next_arrival_index = 0
        sort_key = (
            self._priority_key
            if scheduler_config.scheduling_policy == "priority"
            else self._arrival_key
        )
        self.waiting = RequestQueue(sort_key)
        self.swapped = RequestQueue(sort_key)
        self.running: list[Request] = []  # admission order
        self._finished_req_ids: set[str] = set()
        self._finished_stats: list[FinishedRequestStats] = []  # take_finished_stats
        # Forked completions, and requests whose prefix was loaded from the tier, that
        # the runner has not been told about yet.
        self._unsent_req_ids: set[str] = set()
        # Requests admitted with loads from the prefix cache's tier in the step being run
        # (they compute once the loads are checked).
        self._loading: dict[str, TierLoad] = {}
        self.last_step_prefill_tokens = 0  # prompt positions the last executed step computed
        # Tokens computed, split by position: prompt positions (prefill) and output
        # positions fed back (decode).
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._num_preemptions = {"recompute": 0, "swap": 0}

        if scheduler_config.preemption_mode == "swap" and cache_config.num_cpu_blocks == 0:
            logger.warning(
                "preemption_mode='swap' with num_cpu_blocks=0: every preemption will "
                "fall back to recompute."
            )
        if cache_config.max_num_cached_tokens < self.max_model_len:
            logger.warning(
                "The KV cache holds %d tokens, less than max_model_len=%d: requests that "
                "could grow past the cache are refused when added.",
                cache_config.max_num_cached_tokens,
                self.max_model_len,
            )

    # ---------------------------------------------------------------- queues

    # Background requests (batch lines) sort after all others under every policy.
    def _arrival_key(self, request: Request) -> tuple[bool, int]:
        return request.background, self._arrival_index[request.request_id]

    def _priority_key(self, request: Request) -> tuple[bool, int, float, int]:
        return (request.background, request.priority, request.arrival_time, self._arrival_index[request.request_id])

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_interactive(self) -> int:
        """Waiting requests that are not background work."""
        return sum(1 for request in self.waiting if not request.background)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_unsent_tier_work(self) -> bool:
        """Blocks or snapshots to write to the prefix cache's tier that no step carried
        yet: an engine going idle runs one more (empty) step for them, so a restart finds
        the last conversation's end."""
        return self.kv_cache_manager.has_unsent_tier_work()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------ add / finish

    def add_request(self, request: Request) -> None:
        """Queue a new request, or refuse one that could never be served.

        Resolves request.max_tokens when it is None (up to max_model_len). Raises
        InvalidRequestError naming the parameter to change.
        """
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"A request with id {request.request_id!r} is already running.", "request_id"
            )
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise InvalidRequestError("Only a new request can be added.", "request_id")
        check_request_fits(
            request,
            self.max_model_len,
            self.cache_config,
            self.scheduler_config.max_num_batched_tokens,
            self.scheduler_config.max_num_seqs,
        )
        self.requests[request.request_id] = request
        self._arrival_index[request.request_id] = self._next_arrival_index
        self._next_arrival_index += 1
        self.waiting.add(request)

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """A step that raised: end every request it scheduled or preempted (their state
        may be half-updated) and send its finished ids again, since the runner may never
        have seen them. Returns the ended ids."""
        self._finished_req_ids |= scheduler_output.finished_req_ids
        involved = [*scheduler_output.num_scheduled_tokens, *scheduler_output.preempted_req_ids, *self._loading]
        # A hybrid's request whose state the step was to copy in (a fork, a snapshot) may lack it.
        swaps = scheduler_output.state_swaps
        targets = [target for _, target in (*scheduler_output.state_copies, *scheduler_output.state_restores, *swaps.into)]
        involved += self.kv_cache_manager.state_slots.holders_of(targets)
        self._loading = {}
        tier = self.kv_cache_manager.tier
        if tier is not None:  # writes the runner may not have queued: the queue must not shrink
            offloads = (*scheduler_output.blocks_to_offload, *scheduler_output.states_to_offload)
            tier.cancel_writes(key for key, _ in offloads)
        self.kv_cache_manager.end_snapshot_step(failed=True)  # it may not have written its snapshots
        ended = [request_id for request_id in involved if request_id in self.requests]
        self.finish_requests(ended, RequestStatus.FINISHED_ABORTED)
        return ended

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string), whatever state they are in.

        Unknown or already finished ids are ignored: an abort may race a natural finish.
        The ids are reported in the next SchedulerOutput.finished_req_ids.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            else:
                assert request.status is RequestStatus.SWAPPED
                self.swapped.remove(request)
            self._release(request, status)

    def take_finished_stats(self) -> list[FinishedRequestStats]:
        """What the requests finished since the last call went through (metrics' per-request timings)."""
        stats, self._finished_stats = self._finished_stats, []
        return stats

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Free a finished request, already out of its queue."""
        self._finished_stats.append(FinishedRequestStats(
            request.parent_request_id or request.request_id, request.num_preemptions, request.num_tier_tokens,
        ))  # fmt: skip
        self.kv_cache_manager.free(request)
        request.status = status
        del self.requests[request.request_id]
        del self._arrival_index[request.request_id]
        self._finished_req_ids.add(request.request_id)
        self._unsent_req_ids.discard(request.request_id)
        if self.speculator is not None:
            self.speculator.finished(request.request_id)
        if logger.isEnabledFor(logging.DEBUG):
            cached, tier = request.num_cached_tokens, request.num_tier_tokens
            # A hybrid's hit resumes from a snapshot of its recurrent state at the hit's end.
            state = " and a state snapshot" if self.kv_cache_manager.snapshots.enabled else ""
            logger.debug(
                "request %s %s: %d prompt tokens (%d from the KV cache%s, %d from its tier, %d computed), %d output tokens",
                request.request_id, status.name.lower(), request.num_prompt_tokens, cached - tier, state, tier,
                request.num_prompt_tokens - cached, request.num_output_tokens,
            )  # fmt: skip

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step: the requests to run, their tokens, blocks and swaps."""
        config = self.scheduler_config
        if config.scheduling_policy == "shortest-remaining":
            # Closest to finishing first; the victim (the last) has the most work left.
            self.running.sort(key=lambda r: (remaining_work(r), self._arrival_index[r.request_id]))
        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        budget = config.max_num_batched_tokens
        plan = StepPlan(token_budget=budget, prefill_budget=prefill_token_cap(config, budget, num_decodes))
        plan.speculate = self.speculator is not None and self.speculator.active(len(self.running))
        plan.background_budget = config.background_token_budget
        plan.multi_step = (
            config.num_scheduler_steps > 1
            and not plan.speculate
            and not self.waiting
            and not self.swapped
            and not self._loading
            and all(can_run_several(r) for r in self.running)
        )
        self._schedule_running(plan)
        # A step that had to preempt is short of blocks: bringing requests in now would
        # only get them (or others) preempted again, and swap-ins must not share a step
        # with swap-outs (the host blocks they free could be overwritten).
        if not plan.preempted_req_ids:
            self._schedule_swapped(plan)
            # Swapped requests go first, or new ones could starve them of blocks; only
            # background ones left swapped let interactive requests by.
            if not self.swapped or self.swapped.peek().background:
                self._schedule_waiting(plan)
        return self._make_output(plan)

    def _num_tokens_to_schedule(self, gap: int, plan: StepPlan, request: Request) -> int:
        """Tokens of a gap that fit this step; 0 if the request must wait."""
        assert gap > 0, "nothing to compute"
        if request.background and self._pauses_background(plan):
            return 0
        if not plan.has_adapter_room(request, self.scheduler_config.max_loras):
            return 0  # its adapter would be one too many in this step
        budget = self._token_room(request, plan)
        if gap == 1:  # a decode
            return min(1, budget)
        return prefill_chunk_size(self.scheduler_config, gap, budget, plan.prefill_budget, len(plan.prefill_req_ids))

    @staticmethod
    def _token_room(request: Request, plan: StepPlan) -> int:
        """Tokens the request may still take this step (background work: within its budget)."""
        if request.background and plan.background_budget is not None:
            return min(plan.token_budget, plan.background_budget)
        return plan.token_budget

    def _schedule_running(self, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        config = self.scheduler_config
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            gap = request.num_tokens - request.num_computed_tokens
            num_tokens = self._num_tokens_to_schedule(gap, plan, request)
            if num_tokens == 0:
                index += 1
                continue
            proposal: list[int] = []
            if gap == 1 and plan.speculate and not request.is_pooling:
                assert self.speculator is not None
                # Verification positions count in the step's token budget.
                proposal = self.speculator.propose(request)[: self._token_room(request, plan) - 1]
                num_tokens += len(proposal)
            block_ids = None
            steps = 1
            if gap == 1 and plan.multi_step:
                steps = min(
                    decode_steps(request, config.num_scheduler_steps, self.max_model_len),
                    self._token_room(request, plan),
                )
                # The look-ahead positions take free blocks only: never a preemption.
                block_ids = kv.allocate_slots(request, steps) if steps > 1 else None
                steps = steps if block_ids is not None else 1
                num_tokens = steps
            if block_ids is None:
                block_ids = kv.allocate_slots(request, num_tokens)
            while block_ids is None:
                victim = self._choose_victim()
                victim_index = self.running.index(victim)
                # A victim scheduled earlier in this step (background work goes first) may
                # have copy-on-write blocks still to fill (the runner swaps out before it
                # copies): it is recomputed, not swapped.
                self._preempt(victim, plan, allow_swap=victim.request_id not in plan.num_scheduled_tokens)
                if victim is request:
                    break
                if victim_index < index:
                    index -= 1
                block_ids = kv.allocate_slots(request, num_tokens)
            if block_ids is None:
                continue  # the request itself was preempted; `index` is the next one
            plan.schedule(request, num_tokens, block_ids, is_prefill=gap > 1)
            if proposal:
                plan.spec_tokens[request.request_id] = proposal
            if steps > 1:
                plan.decode_steps[request.request_id] = steps
            index += 1

    def _choose_victim(self) -> Request:
        candidates = [r for r in self.running if r.background] or self.running  # background work first
        if self.scheduler_config.scheduling_policy == "priority":
            return max(candidates, key=self._priority_key)
        return candidates[-1]  # the latest admitted (fcfs) or most work left (sorted)

    def _preempt(self, request: Request, plan: StepPlan, allow_swap: bool = True) -> None:
        self.running.remove(request)
        plan.unschedule(request)
        plan.preempted_req_ids.add(request.request_id)
        events = self.kv_cache_manager.events
        if events is not None:
            events.record("preempt", request.request_id, mode=self.scheduler_config.preemption_mode)
        request.num_preemptions += 1
        # A hybrid's recurrent state swaps only where the host holds slots for it.
        kv = self.kv_cache_manager
        allow_swap = allow_swap and (not kv.state_slots.enabled or kv.host_state_slots.enabled)
        if self.scheduler_config.preemption_mode == "swap" and request.num_computed_tokens and allow_swap:
            pairs = self.kv_cache_manager.swap_out(request)
            if pairs is not None:
                request.status = RequestStatus.SWAPPED
                self.swapped.add(request)
                plan.blocks_to_swap_out.extend(pairs)
                self._num_preemptions["swap"] += 1
                logger.debug("preempted %s by swap (%d blocks)", request.request_id, len(pairs))
                return
            logger.debug("host pool full, preempting %s by recompute", request.request_id)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        self._num_preemptions["recompute"] += 1
        logger.debug("preempted %s by recompute", request.request_id)

    def _pauses_background(self, plan: StepPlan) -> bool:
        """Background work sits this step out while an interactive request waits or
        prefills (decided once per step, when a background request first asks: no cost
        to a step without any)."""
        if plan.pause_background is None:
            plan.pause_background = self._interactive_waiting() or any(
                not r.background and r.num_tokens - r.num_computed_tokens > 1 for r in self.running
            )
        return plan.pause_background

    def _interactive_waiting(self) -> bool:
        return bool(self.waiting) and not self.waiting.peek().background

    def _preempt_background(self, plan: StepPlan) -> bool:
        """Preempt the latest admitted background request; False if none runs."""
        for victim in reversed(self.running):
            if victim.background and victim.request_id not in plan.loading:
                # One scheduled this step may have a copy-on-write block still to fill (the
                # runner swaps out before it copies): it is recomputed, not swapped.
                self._preempt(victim, plan, allow_swap=victim.request_id not in plan.num_scheduled_tokens)
                return True
        return False

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        kv = self.kv_cache_manager
        kv.end_snapshot_step()  # the previous step's snapshots are written
        state_saves: dict[str, list[tuple[int, int]]] = {}
        for request_id in plan.num_scheduled_tokens:
            request = self.requests[request_id]
            if kv.snapshots.enabled and request_id not in plan.decode_steps:
                saves = kv.plan_state_saves(request, plan.num_scheduled_tokens[request_id])
                if saves:
                    state_saves[request_id] = saves
            if request_id in plan.resumed_req_ids or request_id in self._unsent_req_ids:
                self._unsent_req_ids.discard(request_id)
                new_reqs.append(
                    NewRequestData(
                        req_id=request_id,
                        # Copies: the runner may keep them and append its own samples.
                        prompt_token_ids=list(request.prompt_token_ids),
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=self.kv_cache_manager.get_block_tables(request_id),
                        num_computed_tokens=request.num_computed_tokens,
                        eos_token_ids=request.eos_token_ids,
                        num_pending_forks=request.num_pending_forks,
                        pooling_params=request.pooling_params,
                        lora_request=request.lora_request,
                        state_slot=self.kv_cache_manager.state_slots.slot_of(request_id),
                    )
                )
            else:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=request_id,
                        new_block_ids=plan.new_block_ids[request_id],
                        num_computed_tokens=request.num_computed_tokens,
                        num_kept_block_ids=self.kv_cache_manager.num_device_blocks(request_id)
                        - len(plan.new_block_ids[request_id][0]),
                    )
                )
        finished, self._finished_req_ids = self._finished_req_ids, set()
        self._loading = plan.loading
        blocks_to_load, states_to_load = kv.take_pending_loads()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            preempted_req_ids=plan.preempted_req_ids,
            finished_req_ids=finished,
            blocks_to_swap_out=plan.blocks_to_swap_out,
            blocks_to_swap_in=plan.blocks_to_swap_in,
            blocks_to_copy=kv.take_pending_copies(),
            scheduled_spec_decode_tokens=plan.spec_tokens,
            decode_steps=plan.decode_steps,
            blocks_to_offload=kv.take_pending_offloads(),
            blocks_to_load=blocks_to_load,
            states_to_offload=kv.take_pending_state_offloads(),
            states_to_load=states_to_load,
            tier_deletions=kv.tier.take_deletions() if kv.tier is not None else [],
            state_copies=kv.state_slots.take_pending_copies(),
            state_restores=kv.take_pending_restores(),
            state_swaps=kv.take_pending_state_swaps(),
            state_saves=state_saves,
        )

    # ------------------------------------------------------------ inspection

    def make_stats(self) -> SchedulerStats:
        track_adapters = bool(self.scheduler_config.max_loras)
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_swapped=self.num_swapped,
            num_preemptions_recompute=self._num_preemptions["recompute"],
            num_preemptions_swap=self._num_preemptions["swap"],
            num_prefill_tokens=self._num_prefill_tokens,
            num_decode_tokens=self._num_decode_tokens,
            running_by_adapter=by_adapter(self.running) if track_adapters else {},
            waiting_by_adapter=by_adapter([*self.waiting, *self.swapped]) if track_adapters else {},
            **kv_cache_fields(self.kv_cache_manager),
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if queues, request states and blocks disagree."""
        check_scheduler_integrity(
            kv=self.kv_cache_manager,
            requests=self.requests,
            running=self.running,
            waiting=self.waiting,
            swapped=self.swapped,
            max_num_seqs=self.scheduler_config.max_num_seqs,
        )
