"""Sim stage: the same workload on the real engine, measured like the simulator.

For validating the simulator: requests are added to an LLMEngine at their arrival times
(wall clock from the start), every step is timed, and a token counts as received when
the step that produced it returns, exactly the simulator's definitions. The result is a
SimResult, so report.summarize_sim describes both runs with the same code.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagellm.errors import InvalidRequestError
from pagellm.sampling_params import SamplingParams
from pagellm.sim.engine_probe import EngineProbe
from pagellm.sim.request_stream import SimRequest
from pagellm.core.scheduler_stats import SchedulerStats
from pagellm.sim.simulator import KVSampler, SimRequestResult, SimResult
from pagellm.core.step_batch import StepBatch

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class MeasuredRun:
    result: SimResult
    steps: list[tuple[StepBatch, float]]  # every step's batch and measured seconds


def run_on_engine(
    engine: LLMEngine,
    requests: Sequence[SimRequest],
    *,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    after_step: Callable[[], None] | None = None,
) -> MeasuredRun:
    """Serve `requests` on `engine` in real time; the engine must be idle.

    `after_step` is called after every step (a benchmark can abort a disturbed run from
    it by raising).
    """
    assert not engine.has_unfinished_requests(), "the engine must start idle"
    probe = EngineProbe(engine)
    scheduler = engine.scheduler
    config = engine.config
    sampler = KVSampler(scheduler, config.scheduler_config.max_model_len, config.cache_config.block_size)
    stats_before = scheduler.make_stats()
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    finish: dict[int, float] = {}
    num_output: dict[int, int] = {}
    rejected: dict[int, str] = {}
    itl = array("d")
    steps: list[tuple[StepBatch, float]] = []
    next_index = 0
    now = 0.0
    start = clock()
    while next_index < len(order) or engine.has_unfinished_requests():
        now = clock() - start
        while next_index < len(order) and requests[order[next_index]].arrival_s <= now:
            index = order[next_index]
            next_index += 1
            request = requests[index]
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=request.output_len)
            try:
                engine.add_request(str(index), request.prompt_token_ids, params)
            except InvalidRequestError as e:
                rejected[index] = e.parameter or "invalid"
        if not engine.has_unfinished_requests():
            if next_index < len(order):
                sleep(max(0.0, requests[order[next_index]].arrival_s - (clock() - start)))
            continue
        outputs, batch, seconds = probe.step()
        now = clock() - start
        steps.append((batch, seconds))
        for output in outputs:
            index = int(output.request_id)
            new_tokens = len(output.outputs[0].delta_token_ids)
            if not new_tokens:
                continue
            if index not in first:
                first[index] = now
            else:
                itl.append(now - last[index])
            last[index] = now
            num_output[index] = num_output.get(index, 0) + new_tokens
            if output.finished:
                finish[index] = now
        sampler.sample_until(now)
        if after_step is not None:
            after_step()
    stats = scheduler.make_stats()
    results = [
        SimRequestResult(
            request.arrival_s, len(request.prompt_token_ids), num_output.get(index, 0),
            request.output_len, first.get(index), finish.get(index), rejected.get(index),
        )  # fmt: skip
        for index, request in enumerate(requests)
    ]
    result = SimResult(
        requests=results,
        itl_s=itl,
        kv_samples=sampler.samples,
        kv_sample_interval_s=sampler.interval,
        stats=_since(stats, stats_before),
        num_steps=len(steps),
        busy_s=sum(seconds for _, seconds in steps),
        duration_s=now,
        num_extrapolated_steps=0,
        wall_s=now,
        scheduler_config=config.scheduler_config,
        cache_config=config.cache_config,
        cost_model={"kind": "real engine"},
    )
    return MeasuredRun(result, steps)


# Gauges of SchedulerStats; every other num_* field is a cumulative counter.
_GAUGES = ("num_running", "num_waiting", "num_swapped", "num_free_blocks")


def _since(stats: SchedulerStats, before: SchedulerStats) -> SchedulerStats:
    """Counters accumulated during the run (the engine may have served a warm-up)."""
    counters = {
        field.name: getattr(stats, field.name) - getattr(before, field.name)
        for field in dataclasses.fields(stats)
        if field.name.startswith("num_") and field.name not in _GAUGES
    }
    return dataclasses.replace(stats, **counters)
