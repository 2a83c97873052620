"""Core stage: accounting for an executed step: the scheduler's update_from_output.

The runner has computed the step schedule() decided: positions whose KV is now in the
cache advance num_computed_tokens (a verified speculation keeps only its accepted ones),
sampled tokens are appended up to the first that stops the request, embedding requests
whose prompt is computed finish, n > 1 requests fork their other completions, and the
step's loads from the prefix cache's tier count as computed up to the first that failed.

A mixin of Scheduler (core/scheduler.py), which owns the state it reads and changes; kept
apart so that deciding a step and accounting for one are each read on their own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagellm.core.parallel_sampling import make_child_request
from pagellm.core.scheduler_output import ModelRunnerOutput, RequestProgress, SchedulerOutput
from pagellm.core.stop_conditions import check_stop
from pagellm.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagellm.config import CacheConfig
    from pagellm.core.kv_cache_manager import KVCacheManager
    from pagellm.core.kv_tier_access import TierLoad
    from pagellm.core.request_queue import RequestQueue
    from pagellm.core.speculator_interface import Speculator

logger = logging.getLogger(__name__)


class StepAccounting:
    """update_from_output and its parts, on Scheduler's state (declared here for readers;
    finished requests leave through Scheduler._release)."""

    cache_config: CacheConfig
    kv_cache_manager: KVCacheManager
    speculator: Speculator | None
    max_model_len: int
    requests: dict[str, Request]
    running: list[Request]
    last_step_prefill_tokens: int
    _arrival_index: dict[str, int]
    _next_arrival_index: int
    _unsent_req_ids: set[str]
    waiting: RequestQueue
    _loading: dict[str, TierLoad]
    _num_prefill_tokens: int
    _num_decode_tokens: int

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestProgress]:
        """Account for an executed step: advance, append samples, check stops, finish.

        Returns progress for every request that got tokens or finished in this step.
        Requests finished from outside since schedule() are skipped.
        """
        kv = self.kv_cache_manager
        report = runner_output.kv_tier
        if kv.tier is not None and report is not None:
            kv.tier.apply_report(report)
            kv.tier_cost.observe_read(report.bytes_loaded, report.load_seconds)
        if self._loading:
            # No report: the runner loaded nothing (it always reports a step with loads).
            failed = (
                set(report.failed_loads) if report is not None
                else {key for key, _ in (*scheduler_output.blocks_to_load, *scheduler_output.states_to_load)}
            )  # fmt: skip
            self._finish_loads(failed)
        progress: list[RequestProgress] = []
        finished: list[Request] = []
        num_prefill_before = self._num_prefill_tokens
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            num_prompt_part = max(
                0, min(request.num_prompt_tokens - request.num_computed_tokens, num_tokens)
            )
            self._num_prefill_tokens += num_prompt_part
            self._num_decode_tokens += num_tokens - num_prompt_part
            # Positions whose KV stays: all, or of a verified proposal the accepted ones
            # (later steps write the rejected positions again).
            proposal = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            kept = num_tokens if not proposal else self._verified(request_id, proposal, runner_output)
            computed = request.num_computed_tokens + kept
            if computed < request.num_tokens:  # a partial prefill chunk: nothing sampled
                request.num_computed_tokens = computed
                kv.cache_blocks(request, computed)
                kv.free_passed_blocks(request)
                continue
            if request.is_pooling:  # the prompt is computed: pooled, nothing sampled, done
                progress.append(self._finish_pooling(request, computed, runner_output, finished))
                continue
            sampled = runner_output.sampled_token_ids.get(request_id)
            if not sampled:
                raise RuntimeError(
                    f"The runner returned no sampled token for request {request_id!r}, "
                    "which reached the end of its tokens this step."
                )
            steps = scheduler_output.decode_steps.get(request_id)
            if steps is not None and len(sampled) != steps:
                raise RuntimeError(f"The runner returned {len(sampled)} tokens for request {request_id!r}, not {steps}.")
            new_token_ids = self._append_sampled(request, sampled, finished)
            # A stop inside an accepted run leaves fewer tokens than computed positions.
            request.num_computed_tokens = min(computed, request.num_tokens)
            kv.cache_blocks(request, request.num_computed_tokens)
            if proposal:  # blocks holding only rejected positions go back to the pool
                kv.trim(request, request.num_tokens)
            kv.free_passed_blocks(request)
            progress.append(
                RequestProgress(
                    req_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
            forked = runner_output.forked_token_ids.get(request_id)
            if request.num_pending_forks and forked:
                progress.extend(self._fork(request, forked, finished))
        self.last_step_prefill_tokens = self._num_prefill_tokens - num_prefill_before
        if finished:
            finished_ids = {request.request_id for request in finished}
            self.running = [r for r in self.running if r.request_id not in finished_ids]
            for request in finished:
                self._release(request, request.status)
        return progress

    def _finish_pooling(
        self, request: Request, computed: int, runner_output: ModelRunnerOutput, finished: list[Request]
    ) -> RequestProgress:
        """An embedding request whose prompt is now computed: its blocks enter the prefix
        cache (later prompts with the same start hit them) and it finishes."""
        if request.request_id not in runner_output.pooled:
            raise RuntimeError(
                f"The runner returned no embedding for request {request.request_id!r}, whose prompt it completed."
            )
        request.num_computed_tokens = computed
        self.kv_cache_manager.cache_blocks(request, computed)
        request.status = RequestStatus.FINISHED_STOPPED
        finished.append(request)
        return RequestProgress(request.request_id, [], request.finish_reason, None)

    def _append_sampled(self, request: Request, sampled: list[int], finished: list[Request]) -> list[int]:
        """Append sampled tokens up to the first that stops the request."""
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            status = check_stop(request, token_id, self.max_model_len)
            if status is not None:
                request.status = status
                finished.append(request)
                break
        return new_token_ids

    def _verified(self, request_id: str, proposal: list[int], runner_output: ModelRunnerOutput) -> int:
        """A verified proposal (the draft's tokens where the runner drafted them): the
        positions whose KV stays, i.e. the request's next token and the accepted ones."""
        emitted = runner_output.sampled_token_ids.get(request_id)
        proposal = runner_output.drafted_token_ids.get(request_id, proposal)
        if not emitted or len(emitted) > len(proposal) + 1:
            raise RuntimeError(f"The runner's verification of {request_id!r} emitted {emitted!r}.")
        num_accepted = len(emitted) - 1
        assert emitted[:num_accepted] == proposal[:num_accepted], "accepted tokens are the proposed ones"
        if self.speculator is not None:
            self.speculator.record(self.requests[request_id], len(proposal), num_accepted)
        return 1 + num_accepted

    def _fork(
        self, parent: Request, first_token_ids: list[int], finished: list[Request]
    ) -> list[RequestProgress]:
        """Start completions 1..n-1 of `parent`, sharing its prompt blocks.

        Each child begins with its own first token (sampled by the runner from the
        parent's prompt logits) and the prompt's KV already computed.
        """
        assert len(first_token_ids) == parent.num_pending_forks
        parent.num_pending_forks = 0
        progress = []
        for index, token_id in enumerate(first_token_ids, start=1):
            child = make_child_request(parent, index)
            self.kv_cache_manager.fork(parent, child)
            self.requests[child.request_id] = child
            self._arrival_index[child.request_id] = self._next_arrival_index
            self._next_arrival_index += 1
            self.running.append(child)
            self._unsent_req_ids.add(child.request_id)
            child.append_output_token_ids(token_id)
            status = check_stop(child, token_id, self.max_model_len)
            if status is not None:
                child.status = status
                finished.append(child)
            progress.append(
                RequestProgress(
                    req_id=child.request_id,
                    new_token_ids=[token_id],
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        return progress

    def _finish_loads(self, failed: set[bytes]) -> None:
        """The loads of the step just run are done: each loading request counts as
        computed the blocks up to its first failed load (the rest it computes). A
        hybrid's request needs the state at the end of its loads: when any of its loads
        failed it goes back to the waiting queue, to be looked up again (the failed
        entries are gone from the tier)."""
        loading, self._loading = self._loading, {}
        kv = self.kv_cache_manager
        block_size = self.cache_config.block_size
        for request_id, load in loading.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            digests = load.block_digests
            # A block index loaded when every KV cache group's entry of it did.
            num_loaded = next(
                (i for i, digest in enumerate(digests) if any(key in failed for key in kv.group_keys(digest))), len(digests)
            )  # fmt: skip
            # A hybrid needs the state at the end of its loads, a sliding group the blocks its
            # window reads there (loaded only for the run's end): a failed load sends either back.
            partial = num_loaded < len(digests) and (kv.state_slots.enabled or kv.has_sliding_groups)
            if partial or (kv.state_slots.enabled and load.state_key in failed):
                logger.info("request %s: its prefix failed to load from the tier; looked up again", request_id)
                self.running.remove(request)
                kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
                continue
            request.num_computed_tokens += num_loaded * block_size
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
                request.num_tier_tokens = num_loaded * block_size
            kv.cache_blocks(request, request.num_computed_tokens)
            self._unsent_req_ids.add(request_id)
