"""`pagellm calibrate`: the sweep on a real (tiny) engine, the fit, the file, and its use."""

from __future__ import annotations

import json

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm.config.engine_args import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.cli import main
from pagellm.errors import ConfigError
from pagellm.sim.calibrated import CalibratedCostModel
from pagellm.sim.calibration_sweep import calibrate_engine, sweep_cases


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-calibrate"), "llama", seed=5))


def test_cases_respect_the_engine_limits():
    cases = sweep_cases(max_num_seqs=16, max_num_batched_tokens=200, max_model_len=256)
    labels = [case.label for case in cases]
    assert "decode x16 ctx16" in labels and "decode x24 ctx16" not in labels
    assert all(f"decode x{n} ctx16" in labels for n in range(1, 9))
    assert all(r.prompt_len <= 200 for case in cases for r in case.requests)
    assert "prefill 256" not in labels and "prefill 96" in labels
    assert {"mixed steady", "mixed bursts"} <= set(labels)
    assert sweep_cases(16, 200, 256, seed=1) == sweep_cases(16, 200, 256, seed=1)


def test_calibrating_a_real_engine(tiny_model, tmp_path):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model, max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
        disable_log_stats=True,
    ))  # fmt: skip
    seen: list[str] = []
    model, measured = calibrate_engine(engine, quick=True, on_case=lambda case, steps: seen.append(case.label))
    assert not engine.has_unfinished_requests()
    assert len(seen) == len(sweep_cases(32, 256, 512, quick=True))
    assert model.fit.quality.num_steps == len(measured) > 20
    assert all(m.seconds > 0 and m.batch.num_tokens > 0 for m in measured)
    # Timing is the machine's business (tests never assert on it): only the shape of the fit.
    assert all(v >= 0 for v in (*model.fit.base_s, *model.fit.decode_context_s))
    assert {1, 2, 4, 7, 8, 16} <= set(model.fit.token_knots)
    assert all(model.predict(m.batch) > 0 for m in measured)
    # Every request the sweep added was computed: prompts as prefill, outputs as decodes.
    stats = engine.get_stats()
    assert sum(m.batch.num_tokens for m in measured) < stats.num_prefill_tokens + stats.num_decode_tokens
    assert model.metadata["max_measured_reqs"] == 16  # the quick sweep decodes up to 16 at once
    assert model.model_config.hidden_size == 64 and model.dtype == "float32"
    # float32 has no native decode path; its fit has no native curve.
    assert model.metadata["native_decode_max_reqs"] == 0 and model.fit.native_knots == ()
    path = tmp_path / "fit.json"
    model.save(path)
    assert CalibratedCostModel.load(path).predict(measured[0].batch) == model.predict(measured[0].batch)


def test_a_later_calibration_fits_the_earlier_sweeps_steps_too(tiny_model):
    # Sweeps on both sides of a run: the second call fits its own steps and the first's.
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128,
        disable_log_stats=True,
    ))  # fmt: skip
    first, earlier = calibrate_engine(engine, quick=True)
    second, measured = calibrate_engine(engine, quick=True, earlier=earlier, earlier_sweeps=1)
    assert measured[: len(earlier)] == earlier and len(measured) > len(earlier)
    assert second.fit.quality.num_steps == len(measured) and first.fit.quality.num_steps == len(earlier)
    assert first.metadata["sweeps"] == 1 and second.metadata["sweeps"] == 2


def test_calibrating_a_bf16_engine_fits_its_native_decode_path(tiny_model):
    from pagellm.kernels.linear_bindings import cpu_linear_kernels

    if cpu_linear_kernels() is None:
        pytest.skip("no native decode path on this CPU (needs x86-64 with AVX2 and a C compiler)")
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model, dtype="bfloat16", max_model_len=512, max_num_seqs=32,
        max_num_batched_tokens=256, disable_log_stats=True,
    ))  # fmt: skip
    model, _ = calibrate_engine(engine, quick=True)
    from pagellm.kernels.decode_layer import MAX_ROWS

    assert model.metadata["native_decode_max_reqs"] == MAX_ROWS
    assert model.fit.native_decode_max_reqs == MAX_ROWS and 1 in model.fit.native_knots


def test_calibrate_then_simulate_on_the_command_line(tiny_model, tmp_path, capsys):
    path = tmp_path / "cal.json"
    assert main(["calibrate", "--model", tiny_model, "--quick", "--max-model-len", "256",
                 "--max-num-seqs", "16", "--output", str(path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[0])["bench"] == "calibrate"
    assert "fit: R^2" in out and path.exists()
    assert main(["simulate", "--calibration", str(path), "--num-requests", "12", "--request-rate", "4",
                 "--prompt-len", "8", "64", "--output-len", "4", "16", "--max-model-len", "256", "--json"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert record["cost_model"]["kind"] == "calibrated"
    assert record["target"]["device"] == "CPU" and record["results"]["completed"] == 12


def test_several_sweeps_are_fitted_together(tiny_model):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128,
        disable_log_stats=True,
    ))  # fmt: skip
    one, measured_once = calibrate_engine(engine, quick=True)
    engine.scheduler.kv_cache_manager.reset_prefix_cache()  # no hits on the first call's prompts
    two, measured_twice = calibrate_engine(engine, quick=True, sweeps=2)
    assert len(measured_twice) == 2 * len(measured_once) == two.fit.quality.num_steps
    assert two.metadata["sweeps"] == 2 and one.metadata["sweeps"] == 1
    with pytest.raises(ConfigError, match="sweeps"):
        calibrate_engine(engine, quick=True, sweeps=0)
