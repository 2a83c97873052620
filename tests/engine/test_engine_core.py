"""The engine and the simulator step through the same EngineCore (engine/core.py): on the
same request stream with the same (simulated) executor they schedule the same steps, and a
step that raises is reported, not raised."""

from __future__ import annotations

from typing import Any

import pytest

from pagellm.config.cache import CacheSize
from pagellm.config.engine_args import EngineArgs
from pagellm.config.engine_config import DeviceFacts, resolve_engine_config
from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.engine.core import EngineCore
from pagellm.engine.llm_engine import LLMEngine
from pagellm.executor.base import ExecutorReport
from pagellm.model.checkpoint import load_model_config, load_tokenizer, resolve_model_source
from pagellm.sampling_params import SamplingParams
from pagellm.sim.request_stream import SimRequest
from pagellm.sim.simulator import SimulatedExecutor, Simulator
from pagellm.structured.grammar_compiler import GrammarCompiler


class FixedCost:
    name = "fixed"

    def predict(self, batch: Any) -> float:
        return 0.01 + 0.001 * batch.num_tokens

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def step_view(output: SchedulerOutput) -> tuple:
    """What a step schedules, without the requests' sampling parameters (the engine's are
    the user's, the simulator's its own)."""
    return (
        list(output.num_scheduled_tokens.items()),
        [(new.req_id, new.block_ids, new.num_computed_tokens, new.prompt_token_ids) for new in output.scheduled_new_reqs],
        [(c.req_id, c.new_block_ids, c.num_computed_tokens, c.num_kept_block_ids) for c in output.scheduled_cached_reqs],
        sorted(output.preempted_req_ids), sorted(output.finished_req_ids),
        output.blocks_to_swap_out, output.blocks_to_swap_in, output.blocks_to_copy,
    )  # fmt: skip


class Recording:
    """An executor that records each step's schedule and lets a simulated one run it."""

    can_recover_from_step_failures = True

    def __init__(self) -> None:
        self.inner: SimulatedExecutor | None = None
        self.steps: list[tuple] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(step_view(scheduler_output))
        assert self.inner is not None
        return self.inner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass

    def describe(self) -> ExecutorReport:
        return ExecutorReport()


PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate([40, 5, 90, 17, 64, 33, 3, 120])]
OUTPUT_LENS = [12, 30, 4, 25, 9, 18, 40, 6]


def test_the_engine_and_the_simulator_schedule_the_same_steps():
    source = resolve_model_source(None)
    model_config = load_model_config(source)
    tokenizer = load_tokenizer(source, model_config)
    # A small cache and step budget: chunked prefill, queueing and preemption all happen.
    args = EngineArgs(max_model_len=160, max_num_seqs=4, max_num_batched_tokens=48, dtype="float32", seed=0)
    config = resolve_engine_config(args, source, model_config, DeviceFacts())
    config = config.with_cache(config.sized_cache(CacheSize(num_gpu_blocks=12, num_cpu_blocks=0, kv_cache_bytes=0, how="test")))
    recording = Recording()
    engine = LLMEngine(config, tokenizer, recording, GrammarCompiler(tokenizer, model_config.vocab_size))  # type: ignore[arg-type]
    recording.inner = SimulatedExecutor(engine.scheduler, FixedCost())
    for i, (prompt, n) in enumerate(zip(PROMPTS, OUTPUT_LENS, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), arrival_time=0.0)
    produced = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced[output.request_id] = len(output.outputs[0].token_ids)
        assert engine.last_step is not None and engine.last_step.batch.num_tokens == engine.last_step.scheduler_output.total_num_scheduled_tokens
    assert produced == {str(i): n for i, n in enumerate(OUTPUT_LENS)}

    simulator = Simulator(config.scheduler_config, config.cache_config, FixedCost())
    simulated = Recording()
    simulated.inner = simulator.executor
    simulator.core.executor = simulated
    result = simulator.run([SimRequest(0.0, prompt, n) for prompt, n in zip(PROMPTS, OUTPUT_LENS, strict=True)])
    assert [r.num_output_tokens for r in result.requests] == OUTPUT_LENS
    assert engine.get_stats().num_preemptions_recompute > 0  # the stream exercised preemption
    assert len(simulated.steps) == len(recording.steps) > len(PROMPTS)
    for index, (sim_step, engine_step) in enumerate(zip(simulated.steps, recording.steps, strict=True)):
        assert sim_step == engine_step, f"step {index} differs"
    engine.close()


class Failing:
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise RuntimeError("boom")


class Dead(Exception):
    pass


class Dying:
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise Dead()


def test_a_failed_step_is_recorded_and_chosen_errors_propagate():
    from pagellm.config import CacheConfig, SchedulerConfig
    from pagellm.request import Request

    scheduler_config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    cache_config = CacheConfig(block_size=16, num_gpu_blocks=9)
    from pagellm.core.scheduler import Scheduler

    scheduler = Scheduler(scheduler_config, cache_config)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    record = EngineCore(scheduler, Failing()).step()
    assert record.failed and isinstance(record.error, RuntimeError) and record.runner_output is None
    assert list(record.scheduler_output.num_scheduled_tokens) == ["a"] and record.batch.num_tokens == 3
    with pytest.raises(Dead):
        EngineCore(scheduler, Dying(), reraise=(Dead,)).step()
