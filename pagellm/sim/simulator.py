"""Sim stage: the real scheduler and KV cache manager on a simulated clock.

The step loop is the engine's own EngineCore (engine/core.py: schedule() -> execute ->
update_from_output()), on the very Scheduler (and through it the KVCacheManager and
BlockPool) that LLMEngine uses. Only the executor is replaced: SimulatedExecutor returns
one sampled token for every request that reaches the end of its tokens (with
speculation, a verification's accepted tokens and one more, speculation.py), and
advances the core's clock by the step duration the cost model predicts. Requests
arriving while a step runs join at the next step, as in the engine's loop; an idle
engine jumps to the next arrival.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core.scheduler import Scheduler
from pagellm.core.kv_tier import TierReport
from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler_stats import SchedulerStats
from pagellm.engine.core import EngineCore
from pagellm.errors import InvalidRequestError
from pagellm.metrics.spec_decode_stats import SpecDecodeStats
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.sim.cost_model import StepCostModel
from pagellm.sim.speculation import SimSpeculationConfig, SimSpeculator
from pagellm.sim.request_stream import SimRequest
from pagellm.core.step_batch import batch_from_schedule

logger = logging.getLogger(__name__)

# The token every simulated request samples. Its value only feeds the prefix cache's
# block hashes (the requests ignore EOS and stop at their exact output length).
FAKE_TOKEN_ID = 0
# One token sequence shared by every sampled request of every step: update_from_output
# only reads it.
_SAMPLED = (FAKE_TOKEN_ID,)
# One shared, immutable SamplingParams: the exact length goes in Request.max_tokens.
_SAMPLING = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)
# A step that schedules nothing can follow a preemption; many in a row mean the engine
# would hang, which is a scheduler bug the simulation must not hide.
MAX_IDLE_STEPS = 1000
# KV samples kept over the run: the interval doubles (and every other sample is
# dropped) whenever this many accumulate, so any run length stays bounded.
MAX_KV_SAMPLES = 2048
FIRST_KV_SAMPLE_INTERVAL_S = 0.05


@dataclass(frozen=True)
class SimTier:
    """The prefix cache's disk tier as the simulated runner serves it: writes finish
    within their step (the queue never fills); a step that loads blocks lasts at least
    as long as reading them (loads overlap the step's compute)."""

    read_bytes_per_s: float
    entry_bytes: int  # one block's K/V (and the entry's few header bytes, ignored)
    state_entry_bytes: int = 0  # a hybrid model's snapshot of one request's recurrent state


@dataclass(frozen=True)
class KVSample:
    """The KV cache at one instant of simulated time."""

    time_s: float
    usage: float  # fraction of usable blocks in use
    num_running: int
    num_waiting: int
    logical_tokens: float  # KV tokens the running requests have computed and still need
    paged_tokens: float  # blocks in use x block size / KV cache groups (what paging reserves)
    contiguous_tokens: float  # running x a max_model_len request's blocks (what per-request slabs reserve)


@dataclass(frozen=True)
class SimRequestResult:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # tokens produced (== expected unless rejected)
    expected_output_tokens: int
    first_token_s: float | None  # None: rejected
    finish_s: float | None
    rejected: str | None = None  # the parameter an add_request refusal named


@dataclass(frozen=True)
class SimResult:
    requests: list[SimRequestResult]
    itl_s: array  # every gap between consecutive tokens of a request (array of 'd')
    kv_samples: list[KVSample]
    kv_sample_interval_s: float
    stats: SchedulerStats  # the scheduler's own counters at the end
    num_steps: int
    busy_s: float  # simulated time spent in steps (the rest is idle); replicas: their mean
    duration_s: float  # simulated time from 0 to the last step's end
    num_extrapolated_steps: int  # steps outside a calibrated cost model's measured range
    wall_s: float  # real seconds the simulation took
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    cost_model: dict = field(default_factory=dict)
    # Speculative decoding: what was assumed, and what the verifications came to
    # (both None without speculation).
    speculation: SimSpeculationConfig | None = None
    spec_decode: SpecDecodeStats | None = None


class SimulatedExecutor:
    """Executes a step on paper: the sampled tokens a real runner would report (their
    values feed only the prefix cache's hashes), and the predicted duration, by which it
    advances its clock (the engine core's)."""

    def __init__(
        self,
        scheduler: Scheduler,
        cost_model: StepCostModel,
        speculator: SimSpeculator | None = None,
        tier: SimTier | None = None,
    ) -> None:
        self.requests = scheduler.requests  # read-only: what a runner knows of its requests
        self.block_size = scheduler.cache_config.block_size
        self.predict = cost_model.predict
        self.outside_range = getattr(cost_model, "outside_measured_range", None)
        self.speculator = speculator
        self.tier = tier
        self.now = 0.0
        self.num_extrapolated_steps = 0

    def clock(self) -> float:
        return self.now

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        sampled: list[str] = []
        batch = batch_from_schedule(output, self.requests, self.block_size, sampled)
        seconds = self.predict(batch)
        if self.outside_range is not None and self.outside_range(batch):
            self.num_extrapolated_steps += 1
        tier_report = None
        if self.tier is not None:
            tier_report, seconds = self._tier_step(output, seconds)
        sampled_token_ids = dict.fromkeys(sampled, _SAMPLED)
        if output.scheduled_spec_decode_tokens:
            assert self.speculator is not None
            for request_id, proposal in output.scheduled_spec_decode_tokens.items():
                sampled_token_ids[request_id] = self.speculator.verify(proposal)  # type: ignore[assignment]
        self.now += seconds
        return ModelRunnerOutput(list(output.num_scheduled_tokens), sampled_token_ids, kv_tier=tier_report)  # type: ignore[arg-type]

    def _tier_step(self, output: SchedulerOutput, seconds: float) -> tuple[TierReport, float]:
        """The tier's part of a step: every write done, every load read at the tier's
        bandwidth beside the compute. Returns the report and the step's duration."""
        tier = self.tier
        assert tier is not None
        written = [(digest, tier.entry_bytes) for digest, _ in output.blocks_to_offload]
        written += [(key, tier.state_entry_bytes) for key, _ in output.states_to_offload]
        num_loads, num_state_loads = len(output.blocks_to_load), len(output.states_to_load)
        num_bytes = num_loads * tier.entry_bytes + num_state_loads * tier.state_entry_bytes
        load_seconds = num_bytes / tier.read_bytes_per_s
        report = TierReport(written, [], [], num_loads, num_bytes, load_seconds, num_bytes, num_state_loads)
        return report, max(seconds, load_seconds)


class _Track:
    __slots__ = ("arrival", "first", "last", "finish", "num_output")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last = 0.0
        self.finish: float | None = None
        self.num_output = 0


class Simulator:
    """Runs a workload through a real Scheduler with a cost model as the clock."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost_model: StepCostModel,
        speculation: SimSpeculationConfig | None = None,
        tier: SimTier | None = None,
    ) -> None:
        self.tier = tier
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.cost_model = cost_model
        self.speculation = speculation
        self.speculator = (
            None if speculation is None
            else SimSpeculator(speculation, scheduler_config.max_model_len, FAKE_TOKEN_ID)
        )  # fmt: skip
        self.scheduler = Scheduler(scheduler_config, cache_config, speculator=self.speculator)
        self.executor = SimulatedExecutor(self.scheduler, cost_model, self.speculator, tier)
        self.core = EngineCore(self.scheduler, self.executor, clock=self.executor.clock)

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        """Serve every request; returns per-request times, ITLs, KV samples, counters.

        A Simulator runs once: its scheduler keeps the finished run's state.
        """
        wall_start = time.perf_counter()
        scheduler = self.scheduler
        assert not scheduler.requests and scheduler.make_stats().num_prefill_tokens == 0, (
            "a Simulator runs one workload"
        )
        cost_model = self.cost_model
        executor = self.executor
        block_size = self.cache_config.block_size
        live = scheduler.requests  # id -> Request, the scheduler's own map
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        tracks: dict[str, _Track] = {}
        rejected: dict[int, str] = {}
        itl = array("d")
        sampler = KVSampler(scheduler, self.scheduler_config.max_model_len, block_size)

        now = 0.0
        busy = 0.0
        num_steps = num_idle_steps = 0
        next_index = 0
        num_requests = len(order)
        while True:
            while next_index < num_requests and requests[order[next_index]].arrival_s <= now:
                index = order[next_index]
                next_index += 1
                sim_request = requests[index]
                request = Request(
                    str(index), sim_request.prompt_token_ids, _SAMPLING,
                    arrival_time=sim_request.arrival_s, max_tokens=sim_request.output_len,
                )  # fmt: skip
                try:
                    scheduler.add_request(request)
                except InvalidRequestError as e:
                    rejected[index] = e.parameter or "invalid"
                    continue
                tracks[request.request_id] = _Track(sim_request.arrival_s)
            if not live:
                if next_index >= num_requests:
                    break
                now = executor.now = requests[order[next_index]].arrival_s  # idle until the next arrival
                sampler.sample_until(now)
                continue

            record = self.core.step()
            if record.error is not None:
                raise record.error
            output, progress = record.scheduler_output, record.progress
            assert progress is not None
            num_steps += 1
            busy += executor.now - now
            now = executor.now
            if output.num_scheduled_tokens:
                num_idle_steps = 0
            else:
                num_idle_steps += 1
                if num_idle_steps > MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"the scheduler scheduled nothing for {num_idle_steps} steps with "
                        f"{len(live)} unfinished requests"
                    )
            for item in progress:
                track = tracks[item.req_id]
                if track.first is None:
                    track.first = now
                else:
                    itl.append(now - track.last)
                track.last = now
                track.num_output += len(item.new_token_ids)
                if item.finish_reason is not None:
                    track.finish = now
            sampler.sample_until(now)

        results = []
        for index, sim_request in enumerate(requests):
            track = tracks.get(str(index))
            results.append(SimRequestResult(
                sim_request.arrival_s, len(sim_request.prompt_token_ids),
                track.num_output if track else 0, sim_request.output_len,
                track.first if track else None, track.finish if track else None,
                rejected.get(index),
            ))  # fmt: skip
        return SimResult(
            requests=results,
            itl_s=itl,
            kv_samples=sampler.samples,
            kv_sample_interval_s=sampler.interval,
            stats=scheduler.make_stats(),
            num_steps=num_steps,
            busy_s=busy,
            duration_s=now,
            num_extrapolated_steps=executor.num_extrapolated_steps,
            wall_s=time.perf_counter() - wall_start,
            scheduler_config=self.scheduler_config,
            cache_config=self.cache_config,
            cost_model=cost_model.describe(),
            speculation=self.speculation,
            spec_decode=self.speculator.stats if self.speculator is not None else None,
        )


class KVSampler:
    """KV cache state at regular instants of simulated time (the state after the last
    step before each instant), with a bounded number of samples."""

    def __init__(self, scheduler: Scheduler, max_model_len: int, block_size: int) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.interval = FIRST_KV_SAMPLE_INTERVAL_S
        self.next_time = 0.0
        # Tokens are counted as whole-model tokens: a block of one KV cache group holds
        # 1 / num_groups of a token's KV, and a slab sized for max_model_len holds each
        # group's blocks for that length (a sliding group's window only).
        cache = scheduler.cache_config
        self.num_groups = len(cache.group_windows)
        self.slab_tokens = (
            cache.max_blocks_per_request(max_model_len, scheduler.scheduler_config.max_num_batched_tokens)
            * block_size / self.num_groups
        )
        self.samples: list[KVSample] = []

    def _needed_tokens(self, num_computed: int) -> float:
        """The KV a request's computed tokens still need, in whole-model tokens (a sliding
        group keeps only the last window - 1 positions)."""
        windows = self.scheduler.cache_config.group_windows
        if windows == (None,):
            return num_computed
        return sum(num_computed if w is None else min(num_computed, w - 1) for w in windows) / self.num_groups

    def sample_until(self, now: float) -> None:
        if now < self.next_time:
            return
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        running = scheduler.running
        num_used_blocks = kv.num_usable_blocks - kv.num_free_blocks
        state = (
            kv.get_usage(),
            len(running),
            scheduler.num_waiting,
            sum(self._needed_tokens(request.num_computed_tokens) for request in running),
            num_used_blocks * self.block_size / self.num_groups,
            len(running) * self.slab_tokens,
        )
        # One sample per interval boundary passed: a long step (or an idle gap) holds
        # the same state for several instants, and time averages must see that.
        while self.next_time <= now:
            self.samples.append(KVSample(self.next_time, *state))
            self.next_time += self.interval
            if len(self.samples) >= MAX_KV_SAMPLES:
                self.samples = self.samples[::2]
                self.interval *= 2
                self.next_time = self.samples[-1].time_s + self.interval
