"""Test harness of the scheduler: configs, requests, a fake runner that checks KV content.

The fake runner plays the runner's side of the SchedulerOutput contract. Instead of
tensors it keeps, per cache slot, the (KV cache group, token id, position, LoRA adapter)
whose KV it holds; every step it checks that each scheduled request's earlier positions that its
layers read (all of them, or a sliding group's window) read back, through that group's
block table, exactly its own tokens under its own adapter. So a block shared, evicted, swapped, reused or freed
by a window too early shows up as a failed assertion, not only as a wrong count.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core import ModelRunnerOutput, RequestProgress, Scheduler, SchedulerOutput
from pagellm.core.kv_tier import TierReport
from pagellm.core.parallel_sampling import child_request_id
from pagellm.lora.request import LoRARequest
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

TIER_ENTRY_BYTES = 10
Slot = tuple[int, int, int, int]  # (group, token id, position, LoRA adapter id) whose KV a cache slot holds
SampleFn = Callable[[str, list[int]], int]  # (request id, its tokens so far) -> token


def make_scheduler(
    *,
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 0,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    scheduling_policy: str = "fcfs",
    preemption_mode: str = "recompute",
    group_windows: tuple[int | None, ...] = (None,),
    kv_offload_bytes: int = 0,
    kv_offload_max_pending_writes: int = 256,
    num_state_slots: int = 0,
    num_state_snapshots: int = 0,
    state_snapshot_interval: int = 4,
    num_host_state_slots: int | None = None,  # None: one per state slot under swap preemption
    **balance: object,
) -> Scheduler:
    cache_config = CacheConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        enable_prefix_caching=enable_prefix_caching,
        group_windows=group_windows,
        kv_offload_bytes=kv_offload_bytes,
        kv_offload_max_pending_writes=kv_offload_max_pending_writes,
        num_state_slots=num_state_slots,
        num_state_snapshots=num_state_snapshots,
        state_snapshot_interval=state_snapshot_interval,
        num_host_state_slots=(num_state_slots if preemption_mode == "swap" else 0)
        if num_host_state_slots is None else num_host_state_slots,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
        preemption_mode=preemption_mode,  # type: ignore[arg-type]
        **balance,  # type: ignore[arg-type]
    )
    return Scheduler(scheduler_config, cache_config)


def make_request(
    request_id: str,
    prompt: list[int] | int,
    *,
    max_tokens: int | None = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
    eos_token_ids: tuple[int, ...] = (),
    background: bool = False,
    lora: int = 0,
    **params: object,
) -> Request:
    """A request; an int prompt means that many distinct tokens derived from the id."""
    if isinstance(prompt, int):
        # crc32, not hash(): str hashes change between runs.
        base = 1000 * (zlib.crc32(request_id.encode()) % 100_000 + 1)
        prompt = [base + i for i in range(prompt)]
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=eos_token_ids,
        arrival_time=arrival_time,
        priority=priority,
        background=background,
        lora_request=LoRARequest(f"adapter{lora}", lora, f"/adapters/{lora}") if lora else None,
    )


def sample_seven(request_id: str, tokens: list[int]) -> int:
    return 7


@dataclasses.dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    num_pending_forks: int = 0
    lora: int = 0  # the adapter its K/V is computed under (0: the base model)
    state_slot: int | None = None  # a hybrid model's recurrent-state slot


class FakeRunner:
    """Executes SchedulerOutputs on a simulated KV cache (see module docstring)."""

    def __init__(
        self,
        block_size: int,
        sample: SampleFn = sample_seven,
        group_windows: tuple[int | None, ...] = (None,),
        fail_load: Callable[[bytes], bool] = lambda digest: False,
    ) -> None:
        self.block_size = block_size
        # While True, the writes finish (a load finds them, as the runner's loader waits for
        # a queued write) but are not reported yet: the scheduler sees them in flight.
        self.hold_write_reports = False
        self._unreported_writes: list[tuple[bytes, int]] = []
        # The prefix cache's tier: digest -> the slots of the block written there (or, for a
        # hybrid's snapshot, its key -> the history it holds). Every write finishes within
        # its step (reported as TIER_ENTRY_BYTES each); a load for which fail_load says
        # True fails (a corrupt entry: removed).
        self.tier: dict[bytes, list] = {}
        self.fail_load = fail_load
        self.num_tier_loads = 0
        self.group_windows = group_windows
        self.sample = sample
        self.device: dict[int, list[Slot | None]] = {}
        self.host: dict[int, list[Slot | None]] = {}
        self.requests: dict[str, _RunnerRequest] = {}
        # A hybrid model's recurrent state, per slot: the tokens it has absorbed, in order
        # (so a slot shared, lost, not reset or not copied at a fork shows as a mismatch).
        self.states: dict[int, list[tuple[int, int]]] = {}
        self.snapshots: dict[int, list[tuple[int, int]]] = {}  # ... and its snapshots for prefix hits
        self.host_states: dict[int, list[tuple[int, int]]] = {}  # ... and the swapped-out requests'
        self.num_steps = 0

    def _slot(self, state: _RunnerRequest, group: int, position: int) -> tuple[int, int]:
        index = position // self.block_size
        assert index < len(state.block_ids[group]), "position beyond the block table"
        return state.block_ids[group][index], position % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for request_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(request_id, None)
        for digest in out.tier_deletions:
            self.tier.pop(digest, None)
        written = []
        for digest, block_id in out.blocks_to_offload:
            self.tier[digest] = list(self.device.get(block_id, [None] * self.block_size))
            written.append((digest, TIER_ENTRY_BYTES))
        for key, snapshot in out.states_to_offload:  # before this step's saves reuse the slot
            self.tier[key] = list(self.snapshots[snapshot])
            written.append((key, TIER_ENTRY_BYTES))
        for device_id, host_id in out.blocks_to_swap_out:
            self.host[host_id] = list(self.device[device_id])
        for source, host in out.state_swaps.out:  # as the runner: before anything reuses the slot
            self.host_states[host] = list(self.states[source])
        for source_id, target_id in out.blocks_to_copy:  # copy-on-write of a forked request
            self.device[target_id] = list(self.device.get(source_id, [None] * self.block_size))
        for host_id, device_id in out.blocks_to_swap_in:
            self.device[device_id] = list(self.host[host_id])
        failed_loads = []
        scheduled_blocks = {b for r in out.scheduled_new_reqs for t in r.block_ids for b in t}
        for digest, device_id in out.blocks_to_load:
            assert device_id not in scheduled_blocks, "a load targets a block the step reads"
            if digest not in self.tier or self.fail_load(digest):
                failed_loads.append(digest)
                self.tier.pop(digest, None)
                self.device[device_id] = [None] * self.block_size  # a torn copy: nothing valid
                continue
            self.device[device_id] = list(self.tier[digest])
            self.num_tier_loads += 1
        num_loaded = len(out.blocks_to_load) - len(failed_loads)
        for source, target in out.state_copies:  # a fork starts from its parent's state
            self.states[target] = list(self.states[source])
        for host, target in out.state_swaps.into:  # a swapped-in request's state comes back
            self.states[target] = list(self.host_states[host])
        for snapshot, target in out.state_restores:  # a prefix hit resumes from a snapshot
            self.states[target] = list(self.snapshots[snapshot])
        num_states = 0
        for key, target in out.states_to_load:  # ... or from one in the tier
            if key not in self.tier or self.fail_load(key):
                failed_loads.append(key)
                self.tier.pop(key, None)
                self.states[target] = [(-1, -1)]  # a torn copy
                continue
            self.states[target] = list(self.tier[key])
            num_states += 1
        num_entries = num_loaded + num_states
        self._unreported_writes.extend(written)
        written = [] if self.hold_write_reports else self._unreported_writes
        if not self.hold_write_reports:
            self._unreported_writes = []
        report = TierReport(
            written, [], failed_loads, num_loaded, num_entries * TIER_ENTRY_BYTES, 0.0,
            (num_entries + len(failed_loads)) * TIER_ENTRY_BYTES, num_states,
        )  # fmt: skip
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.requests, "new request the runner already holds"
            assert len(new.block_ids) == len(self.group_windows)
            self.requests[new.req_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids,
                [list(table) for table in new.block_ids],
                new.num_computed_tokens,
                new.num_pending_forks,
                0 if new.lora_request is None else new.lora_request.lora_int_id,
                new.state_slot,
            )
            if new.state_slot is not None and new.num_computed_tokens == 0:
                self.states[new.state_slot] = []
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            for table, new_ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                assert 0 not in new_ids, "the null block was handed out"
                if cached.num_kept_block_ids is not None:
                    del table[cached.num_kept_block_ids :]
                table.extend(new_ids)
        assert set(out.num_scheduled_tokens) == {
            r.req_id for r in out.scheduled_new_reqs
        } | {r.req_id for r in out.scheduled_cached_reqs}
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        sampled: dict[str, list[int]] = {}
        forked: dict[str, list[int]] = {}
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[request_id]
            steps = out.decode_steps.get(request_id)
            if steps is not None:  # multi-step decoding: compute, sample, feed back, `steps` times
                assert num_tokens == steps > 1 and state.num_computed_tokens == len(state.token_ids) - 1
                sampled[request_id] = []
                for _ in range(steps):
                    self._compute(request_id, state, state.num_computed_tokens + 1)
                    state.token_ids.append(self.sample(request_id, list(state.token_ids)))
                    sampled[request_id].append(state.token_ids[-1])
                continue
            start = state.num_computed_tokens
            end = start + num_tokens
            assert num_tokens > 0 and end <= len(state.token_ids)
            self._compute(request_id, state, end)
            for offset, snapshot in out.state_saves.get(request_id, []):
                assert 0 < offset <= num_tokens and (start + offset) % self.block_size == 0
                self.snapshots[snapshot] = [(state.lora, token) for token in state.token_ids[: start + offset]]
            if end == len(state.token_ids):
                history = list(state.token_ids)
                # n > 1: the other completions' first tokens, from the same position.
                if state.num_pending_forks:
                    forked[request_id] = [
                        self.sample(child_request_id(request_id, index), history)
                        for index in range(1, state.num_pending_forks + 1)
                    ]
                    state.num_pending_forks = 0
                token = self.sample(request_id, history)
                state.token_ids.append(token)
                sampled[request_id] = [token]
            else:
                sampled[request_id] = []
        return ModelRunnerOutput(list(out.num_scheduled_tokens), sampled, forked_token_ids=forked, kv_tier=report)

    def _compute(self, request_id: str, state: _RunnerRequest, end: int) -> None:
        """Positions num_computed_tokens .. end - 1 of the request: check what they read,
        write their slots."""
        start = state.num_computed_tokens
        if state.state_slot is not None:
            absorbed = [(state.lora, token) for token in state.token_ids[:start]]
            assert self.states.get(state.state_slot) == absorbed, f"{request_id}'s state slot holds another history"
            self.states[state.state_slot].extend((state.lora, token) for token in state.token_ids[start:end])
        for group, window in enumerate(self.group_windows):
            # Attention reads every earlier position its layers see through the
            # group's block table: all of them, or the first query's window on.
            first_read = 0 if window is None else max(0, start - window + 1)
            for position in range(first_read, start):
                block_id, offset = self._slot(state, group, position)
                assert block_id != 0, f"{request_id} reads position {position} from the null block"
                held = self.device.get(block_id, [None] * self.block_size)[offset]
                assert held == (group, state.token_ids[position], position, state.lora), (
                    f"{request_id} group {group} position {position} reads {held} from block {block_id}"
                )
            for position in range(start, end):
                block_id, offset = self._slot(state, group, position)
                assert block_id != 0, "the null block was written"
                block = self.device.setdefault(block_id, [None] * self.block_size)
                block[offset] = (group, state.token_ids[position], position, state.lora)
        state.num_computed_tokens = end


@dataclasses.dataclass
class StepResult:
    output: SchedulerOutput
    progress: list[RequestProgress]


def step(scheduler: Scheduler, runner: FakeRunner) -> StepResult:
    """One engine step: schedule -> fake execute -> update, then check integrity."""
    out = scheduler.schedule()
    max_loras = scheduler.scheduler_config.max_loras
    adapters = {scheduler.requests[r].lora_int_id for r in out.num_scheduled_tokens} - {0}
    assert max_loras is None and not adapters or max_loras is not None and len(adapters) <= max_loras, adapters
    progress = scheduler.update_from_output(out, runner.execute(out))
    scheduler.check_integrity()
    return StepResult(out, progress)


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000
) -> list[StepResult]:
    """Step until nothing is unfinished; a step that schedules nothing while requests
    wait is a liveness bug (nothing would ever change)."""
    results = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        result = step(scheduler, runner)
        assert not result.output.is_empty, "idle step with unfinished requests"
        results.append(result)
    raise AssertionError(f"not finished after {max_steps} steps")


def scheduled(result: StepResult) -> dict[str, int]:
    return dict(result.output.num_scheduled_tokens)


def assert_drained(scheduler: Scheduler) -> None:
    """No request left, every block free, every ref count zero, bookkeeping consistent."""
    scheduler.check_integrity()
    assert not scheduler.has_unfinished_requests(), f"left over: {list(scheduler.requests)}"
    assert scheduler.num_running == scheduler.num_waiting == scheduler.num_swapped == 0
    kv = scheduler.kv_cache_manager
    assert not kv.request_ids_holding_blocks()
    assert kv.state_slots.num_free == kv.state_slots.num_slots
    for pool in (kv.device_pool, kv.host_pool):
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert kv.get_usage() == 0.0
