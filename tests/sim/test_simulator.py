"""The simulator drives the engine's own Scheduler and KVCacheManager on a simulated clock."""

from __future__ import annotations

import pytest

from pagellm.workload.synthetic import WorkloadSpec
from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.engine import llm_engine
from pagellm.sim.cost_model import StepCostModel
from pagellm.sim.report import summarize_sim
from pagellm.sim.request_stream import SimRequest, SyntheticWorkload, make_synthetic_requests
from pagellm.sim.simulator import Simulator
from pagellm.core.step_batch import StepBatch


class ConstantCost:
    """Every step takes `seconds`; records the batches it was asked about."""

    name = "constant"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.batches: list[StepBatch] = []

    def predict(self, batch: StepBatch) -> float:
        self.batches.append(batch)
        return self.seconds

    def describe(self) -> dict:
        return {"kind": "constant", "seconds": self.seconds}


def make_simulator(cost: StepCostModel, *, blocks: int = 64, budget: int = 64, seqs: int = 8,
                   max_model_len: int = 64, block_size: int = 4, **scheduler: object) -> Simulator:
    return Simulator(
        SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_model_len, **scheduler),  # type: ignore[arg-type]
        CacheConfig(block_size=block_size, num_gpu_blocks=blocks),
        cost,
    )  # fmt: skip


def assert_drained(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    assert not scheduler.requests and not scheduler.kv_cache_manager.request_ids_holding_blocks()


def test_it_is_the_engines_own_scheduler_and_block_manager():
    simulator = make_simulator(ConstantCost(1.0))
    assert isinstance(ConstantCost(1.0), StepCostModel)
    # The very classes LLMEngine instantiates, not copies.
    assert type(simulator.scheduler) is Scheduler is llm_engine.Scheduler
    assert type(simulator.scheduler.kv_cache_manager) is KVCacheManager
    assert type(simulator.scheduler.kv_cache_manager.device_pool) is BlockPool


def test_times_by_hand_with_a_constant_step():
    # Request 0 arrives at 0.5 with 4 prompt tokens and 3 outputs: prefill step 0.5-1.5
    # (first token), decodes end at 2.5 and 3.5. Request 1 arrives at 2.0, mid-step: it
    # joins the step that starts at 2.5, so its first token comes at 3.5 (TTFT 1.5), its
    # second at 4.5. Then the engine idles until request 2 at 10.0 (1 output: done 11.0).
    cost = ConstantCost(1.0)
    simulator = make_simulator(cost)
    result = simulator.run([
        SimRequest(0.5, [1, 2, 3, 4], 3), SimRequest(2.0, [5, 6], 2), SimRequest(10.0, [7], 1),
    ])  # fmt: skip
    first, second, third = result.requests
    assert (first.first_token_s, first.finish_s) == (1.5, 3.5)
    assert (second.first_token_s, second.finish_s) == (3.5, 4.5)
    assert (third.first_token_s, third.finish_s) == (11.0, 11.0)
    assert sorted(result.itl_s) == [1.0, 1.0, 1.0]
    assert result.num_steps == 5 and result.busy_s == 5.0 and result.duration_s == 11.0
    # The step at 2.5 carried request 0's decode over 5 cached tokens and request 1's prompt.
    assert cost.batches[2] == StepBatch((2,), (0,), (5,), num_sampled_tokens=2)
    summary = summarize_sim(result)
    assert summary["ttft_ms_median"] == 1000.0 and summary["ttft_ms_p99"] == pytest.approx(1490.0)
    assert summary["output_tok_s"] == pytest.approx(6 / 11.0, abs=1e-3)
    assert summary["num_prefill_tokens"] == 7 and summary["num_decode_tokens"] == 3
    assert_drained(simulator.scheduler)


def test_deterministic_for_a_seed():
    spec = WorkloadSpec(kind="mixed", num_requests=60, prompt_len=(4, 40), output_len=(2, 30), seed=7)
    requests = make_synthetic_requests(SyntheticWorkload(spec, request_rate=3.0), max_model_len=64)

    def run() -> dict:
        summary = summarize_sim(make_simulator(ConstantCost(0.05), blocks=24).run(requests))
        return {k: v for k, v in summary.items() if k not in ("sim_wall_s", "simulated_steps_per_s")}

    first = run()
    assert first == run()
    assert first["num_preemptions"] > 0  # 24 blocks of 4 tokens are tight for this load


def test_preemption_and_allocation_failures_come_from_the_scheduler():
    requests = [SimRequest(0.0, list(range(100 * i, 100 * i + 12)), 20) for i in range(6)]
    simulator = make_simulator(ConstantCost(0.01), blocks=17)  # 16 usable blocks = 64 tokens
    result = simulator.run(requests)
    assert all(r.num_output_tokens == 20 for r in result.requests)
    stats = result.stats
    assert stats.num_preemptions_recompute > 0 and stats.num_allocation_failures > 0
    summary = summarize_sim(result)
    assert summary["num_preemptions"] == stats.num_preemptions_recompute
    # Recomputation shows up as extra prefill tokens beyond the 6 x 12 prompt tokens.
    assert summary["num_prefill_tokens"] > 72
    assert_drained(simulator.scheduler)


def test_swap_preemption_is_simulated_with_host_blocks():
    requests = [SimRequest(0.0, list(range(100 * i, 100 * i + 12)), 20) for i in range(6)]
    simulator = Simulator(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, preemption_mode="swap"),
        CacheConfig(block_size=4, num_gpu_blocks=17, num_cpu_blocks=64),
        cost := ConstantCost(0.01),
    )  # fmt: skip
    result = simulator.run(requests)
    assert result.stats.num_preemptions_swap > 0
    assert any(batch.num_swapped_tokens for batch in cost.batches)
    assert_drained(simulator.scheduler)


def test_requests_that_can_never_run_are_rejected_and_counted():
    simulator = make_simulator(ConstantCost(0.1), max_model_len=16)
    result = simulator.run([SimRequest(0.0, [1] * 10, 10), SimRequest(0.0, [2] * 4, 4)])
    refused, served = result.requests
    assert refused.rejected == "max_tokens" and refused.first_token_s is None
    assert served.num_output_tokens == 4
    summary = summarize_sim(result)
    assert summary["rejected"] == 1 and summary["completed"] == 1
    assert summary["rejected_by_parameter"] == {"max_tokens": 1}


def test_kv_samples_are_time_weighted_and_bounded():
    # One request holding 3 blocks of 4 for 200 one-second steps, then idle until a
    # second tiny request at 1000 s: the samples cover the idle time too.
    simulator = make_simulator(ConstantCost(1.0), blocks=11, max_model_len=256, block_size=4)
    result = simulator.run([SimRequest(0.0, list(range(10)), 2), SimRequest(1000.0, [5], 1)])
    samples = result.kv_samples
    assert len(samples) <= 2048
    assert samples[-1].time_s <= result.duration_s
    times = [s.time_s for s in samples]
    gaps = {round(b - a, 9) for a, b in zip(times, times[1:])}
    assert gaps == {result.kv_sample_interval_s}
    busy = [s for s in samples if s.num_running]
    assert busy and all(s.contiguous_tokens == 256 * s.num_running for s in busy)
    assert max(s.usage for s in samples) == pytest.approx(3 / 10)


def test_a_simulator_runs_once():
    simulator = make_simulator(ConstantCost(1.0))
    simulator.run([SimRequest(0.0, [1, 2], 1)])
    with pytest.raises(AssertionError, match="one workload"):
        simulator.run([SimRequest(0.0, [1, 2], 1)])
