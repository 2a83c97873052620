"""The same workload on the real engine and in the simulator: with every request there at
once the schedule does not depend on timing, so both must compute the very same steps."""

from __future__ import annotations

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm.workload.synthetic import WorkloadSpec
from pagellm.config.engine_args import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sim.real_run import run_on_engine
from pagellm.sim.report import summarize_sim
from pagellm.sim.request_stream import SyntheticWorkload, make_synthetic_requests
from pagellm.sim.simulator import Simulator
from pagellm.core.step_batch import StepBatch


class RecordingCost:
    name = "recording"

    def __init__(self) -> None:
        self.batches: list[StepBatch] = []

    def predict(self, batch: StepBatch) -> float:
        self.batches.append(batch)
        return 0.01

    def describe(self) -> dict:
        return {"kind": "recording"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-sim"), "llama", seed=3))


@pytest.mark.parametrize("engine_fields", [
    {"max_num_seqs": 6, "max_num_batched_tokens": 40},  # chunked prefill, queueing
    {"max_num_seqs": 16, "max_num_batched_tokens": 64, "num_gpu_blocks_override": 14},  # preemption
    {"max_num_seqs": 16, "max_num_batched_tokens": 64, "num_gpu_blocks_override": 14,
     "preemption_mode": "swap", "swap_space": 0.001},  # swap
])  # fmt: skip
def test_burst_schedule_is_identical_to_the_engines(tiny_model, engine_fields):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model, max_model_len=48, block_size=4, disable_log_stats=True, **engine_fields
    ))  # fmt: skip
    spec = WorkloadSpec(kind="mixed", num_requests=14, prompt_len=(3, 30), output_len=(1, 12),
                        seed=11, vocab_low=10, vocab_high=250)  # fmt: skip
    requests = make_synthetic_requests(SyntheticWorkload(spec), max_model_len=48)
    measured = run_on_engine(engine, requests)
    assert not engine.has_unfinished_requests()
    cost = RecordingCost()
    simulation = Simulator(engine.config.scheduler_config, engine.config.cache_config, cost).run(requests)
    assert [batch for batch, _ in measured.steps] == cost.batches
    real, sim = summarize_sim(measured.result), summarize_sim(simulation)
    for name in ("completed", "total_output_tokens", "num_preemptions", "num_preemptions_swap",
                 "num_allocation_failures", "num_prefill_tokens", "num_decode_tokens", "num_steps"):  # fmt: skip
        assert real[name] == sim[name], name
    assert real["completed"] == len(requests)
    if "num_gpu_blocks_override" in engine_fields:
        assert real["num_preemptions"] > 0
    # Each request's tokens arrive one per step in both runs.
    assert [r.num_output_tokens for r in measured.result.requests] == [r.output_len for r in requests]
