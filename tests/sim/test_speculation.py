"""Speculative decoding in the simulator: the real scheduler's verifications, with
acceptances drawn from an assumed rate, priced by the cost model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.entrypoints.cli import main
from pagellm.errors import ConfigError
from pagellm.metrics.spec_decode_stats import SpecDecodeStats
from pagellm.model.costs import ModelCosts
from pagellm.sim.gpu_presets import get_gpu_preset
from pagellm.sim.model_presets import get_model_preset
from pagellm.sim.data_parallel import run_replicas
from pagellm.sim.roofline import RooflineCostModel, RooflineParams
from pagellm.sim.speculation import SimSpeculationConfig
from pagellm.sim.request_stream import SimRequest
from pagellm.sim.simulator import SimResult, Simulator
from pagellm.core.step_batch import StepBatch

K = 4


class Recorder:
    """A cost model that records its batches: a constant step, or another model's."""

    name = "recorder"

    def __init__(self, inner: RooflineCostModel | None = None) -> None:
        self.inner = inner
        self.batches: list[StepBatch] = []

    def predict(self, batch: StepBatch) -> float:
        self.batches.append(batch)
        return 1.0 if self.inner is None else self.inner.predict(batch)

    def describe(self) -> dict:
        return {"kind": "recorder"}


def simulate(requests: list[SimRequest], speculation: SimSpeculationConfig | None, cost: Recorder | None = None,
             seqs: int = 16) -> SimResult:
    simulator = Simulator(
        SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=256, max_model_len=512),
        CacheConfig(block_size=4, num_gpu_blocks=512),
        cost or Recorder(),
        speculation,
    )  # fmt: skip
    result = simulator.run(requests)
    scheduler = simulator.scheduler
    scheduler.check_integrity()  # nothing left behind: every block free again
    assert not scheduler.requests and not scheduler.kv_cache_manager.request_ids_holding_blocks()
    return result


def spec(rate: float, **kwargs: object) -> SimSpeculationConfig:
    return SimSpeculationConfig(num_speculative_tokens=K, acceptance_rate=rate, **kwargs)  # type: ignore[arg-type]


def workload(num_requests: int = 6) -> list[SimRequest]:
    return [SimRequest(0.3 * i, list(range(1, 9 + i)), 10 + 3 * i) for i in range(num_requests)]


# (max_tokens, verifications): after the prefill's token, verifications of k emit k + 1
# each; near the end k shrinks to what max_tokens leaves, and a request one token short
# decodes plainly (22: 5+5+5+5 emitted, then one plain decode).
@pytest.mark.parametrize("max_tokens,num_verifications", [(21, 4), (23, 5), (22, 4), (2, 0), (1, 0)])
def test_full_acceptance_emits_k_plus_one_tokens_a_step(max_tokens, num_verifications):
    result = simulate([SimRequest(0.0, [1, 2, 3, 4], max_tokens)], spec(1.0))
    decode_steps = math.ceil((max_tokens - 1) / (K + 1))
    assert result.num_steps == 1 + decode_steps
    (request,) = result.requests
    assert request.num_output_tokens == max_tokens and request.finish_s == result.num_steps
    stats = result.spec_decode
    assert stats is not None and stats.num_verifications == num_verifications
    plain_decodes = decode_steps - num_verifications
    assert stats.num_accepted_tokens == stats.num_proposed_tokens
    assert stats.num_emitted_tokens == max_tokens - 1 - plain_decodes
    assert stats.acceptance_rate == (1.0 if num_verifications else None)


def test_zero_acceptance_takes_the_steps_of_no_speculation():
    plain = simulate(workload(), None)
    rejected = simulate(workload(), spec(0.0))
    # With a constant step cost even the times agree; only the positions computed differ.
    assert rejected.num_steps == plain.num_steps
    assert rejected.requests == plain.requests
    stats = rejected.spec_decode
    assert stats is not None and stats.num_verifications > 0 and stats.num_accepted_tokens == 0
    assert stats.mean_accepted_length == 1.0
    assert rejected.stats.num_decode_tokens == plain.stats.num_decode_tokens + stats.num_proposed_tokens
    assert plain.spec_decode is None and plain.speculation is None


def test_no_step_speculates_above_the_disable_batch_size():
    requests = [SimRequest(0.0, [1, 2, 3, 4 + i], 12) for i in range(3)]  # run together throughout
    off = simulate(requests, spec(1.0, disable_by_batch_size=2))
    assert off.spec_decode == SpecDecodeStats()
    assert off.requests == simulate(requests, None).requests
    on = simulate(requests, spec(1.0, disable_by_batch_size=3))  # "at most N running" speculates
    assert on.spec_decode is not None and on.spec_decode.num_verifications > 0
    assert on.num_steps < off.num_steps
    always = simulate(requests, spec(1.0, disable_by_batch_size=None))
    assert always.num_steps == on.num_steps


def test_acceptances_repeat_with_the_seed_and_follow_the_rate():
    requests = workload(8)
    first, again = simulate(requests, spec(0.6, seed=3)), simulate(requests, spec(0.6, seed=3))
    assert first.requests == again.requests and first.spec_decode == again.spec_decode
    assert simulate(requests, spec(0.6, seed=4)).spec_decode != first.spec_decode
    stats, config = first.spec_decode, spec(0.6)
    assert stats is not None and stats.num_verifications > 30
    # 1 + A + ... + A^k for full-length proposals; near each request's end fewer are proposed.
    assert config.expected_mean_accepted_length == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296)
    assert stats.mean_accepted_length == pytest.approx(config.expected_mean_accepted_length, rel=0.15)
    assert stats.acceptance_rate == pytest.approx(config.expected_acceptance_rate, rel=0.15)


def test_replicas_draw_their_own_acceptances_and_add_up():
    requests = workload(8)
    cache = CacheConfig(block_size=4, num_gpu_blocks=512)
    scheduler = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)
    merged = run_replicas(scheduler, cache, Recorder(), requests, 2, spec(0.6))
    assert merged.speculation == spec(0.6)
    assert merged.spec_decode is not None and merged.spec_decode.num_emitted_tokens > 0
    assert sum(r.num_output_tokens for r in merged.requests) == sum(r.output_len for r in requests)


def test_a_verification_costs_a_little_more_than_one_decode_step():
    model = RooflineCostModel(
        "Llama-3-8B", ModelCosts.from_config(get_model_preset("Llama-3-8B").config, 2),
        get_gpu_preset("H100-SXM"), RooflineParams(),
    )  # fmt: skip
    cost = Recorder(model)
    simulate([SimRequest(0.0, list(range(1, 201)), 6)], spec(0.0), cost)
    # After the prefill: verifications of k proposals, 1 + k positions over the context,
    # every position through the LM head; the last decode has no room left to speculate.
    verify = cost.batches[1]
    assert verify == StepBatch((K + 1,), (200,), (), num_sampled_tokens=K + 1)
    decode = StepBatch((), (), (200,), num_sampled_tokens=1)
    assert cost.batches[-1] == StepBatch((), (), (204,), num_sampled_tokens=1)
    # A small batch is memory-bound: the weights stream once per step either way, so the
    # k extra positions add little, far from k + 1 decode steps.
    assert model.predict(decode) < model.predict(verify) < 1.1 * model.predict(decode)
    assert model.predict(verify) < 0.25 * (K + 1) * model.predict(decode)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"num_speculative_tokens": 0, "acceptance_rate": 0.5}, "--speculative-tokens must be at least 1"),
    ({"num_speculative_tokens": 2, "acceptance_rate": 1.5}, "--spec-acceptance-rate must be in [0, 1]"),
    ({"num_speculative_tokens": 2, "acceptance_rate": 0.5, "disable_by_batch_size": 0}, "at least 1"),
])  # fmt: skip
def test_bad_speculation_configs_are_refused(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        SimSpeculationConfig(**kwargs)


def test_simulate_command_reports_the_assumed_and_observed_figures(capsys, tmp_path):
    result_file = tmp_path / "sim.jsonl"
    argv = ["simulate", "--model", "SmolLM2-135M", "--gpu", "L4", "--num-requests", "12", "--request-rate", "4",
            "--speculative-tokens", "3", "--spec-acceptance-rate", "0.8", "--spec-disable-by-batch-size", "0",
            "--result-file", str(result_file)]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    record = json.loads(result_file.read_text())
    block = record["results"]["spec_decode"]
    assert block["num_speculative_tokens"] == 3 and block["acceptance_rate_assumed"] == 0.8
    assert block["disable_by_batch_size"] is None
    assert block["expected_mean_accepted_length"] == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert block["num_emitted_tokens"] == block["num_accepted_tokens"] + block["num_verifications"] > 0
    assert 0 < block["acceptance_rate"] <= 1 and 1 <= block["mean_accepted_length"] <= 4
    row = next(line for line in lines if line.startswith("speculative decoding"))
    assert "A=0.8" in row and "observed: acceptance rate" in row and "tokens per verification" in row
    assert main(["simulate", "--num-requests", "3", "--json"]) == 0
    assert "spec_decode" not in json.loads(capsys.readouterr().out)["results"]


@pytest.mark.parametrize("argv,fragment", [
    (["--speculative-tokens", "4"], "--speculative-tokens needs --spec-acceptance-rate"),
    (["--spec-acceptance-rate", "0.5"], "--spec-acceptance-rate needs --speculative-tokens"),
    (["--speculative-tokens", "4", "--spec-acceptance-rate", "0.5", "--spec-disable-by-batch-size", "-1"],
     "--spec-disable-by-batch-size must be >= 0"),
])  # fmt: skip
def test_bad_speculation_flags_are_one_error_line(capsys, argv, fragment):
    assert main(["simulate", "--num-requests", "3", *argv]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("pagellm: error:")]
    assert len(errors) == 1 and fragment in errors[0], err


def test_the_config_is_frozen_and_described():
    config = spec(0.5, disable_by_batch_size=8, seed=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.acceptance_rate = 0.9  # type: ignore[misc]
    assert config.expected_acceptance_rate == pytest.approx((0.5 + 0.25 + 0.125 + 0.0625) / 4)
    assert config.describe()["expected_acceptance_rate"] == pytest.approx(0.2344)  # rounded for the record
