"""The new families on the default CPU path (bfloat16, linear layers on the measured
kernels) against HF transformers in float32, judged as tests/default_path.py judges bf16:
teacher-forced top-1 agreement and log-probability bounds from bf16 rounding, under every
scheduling regime of the standard scenarios.

A family whose layer the C layer paths do not compute (Qwen3's q/k norms) runs its layers
in torch around the native linear kernels: this checks that route, where the Llama tests
check the one-call decode layer and the native layer ops."""

import pytest
from hf_models import load_hf_reference

import default_path as dp

NUM_LAYERS = dp.DEFAULT_PATH_SHAPE["num_hidden_layers"]
SCENARIOS = {s.name: s for s in dp.standard_scenarios(256)}


@pytest.fixture(scope="module", autouse=True)
def _needs_native_bf16():
    if not dp.native_bf16_kernels_available():
        pytest.skip("the default bf16 path needs the native CPU kernels (x86-64 with AVX2, and a C compiler)")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = dp.make_default_path_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3", head_dim=64)
    return str(folder), load_hf_reference(folder)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_qwen3_bf16_agrees_with_hf_float32(qwen3, name):
    folder, reference = qwen3
    run = dp.run_scenario(folder, SCENARIOS[name], "bfloat16")
    assert run.paths is None or not (run.paths.fused_decode or run.paths.native_layers_prefill)
    result = dp.teacher_forced(reference, run.completions)
    dp.check_against_reference(result, NUM_LAYERS, name)


def test_qwen3_linear_layers_take_the_measured_kernels(qwen3):
    from pagellm import LLM

    model = LLM(qwen3[0], dtype="bfloat16").engine.runner.model
    assert model.linear_choice is not None and model.layers[0].self_attn.qkv_proj.plan is not None
    assert model.fused_decode is None and model.native_layers is None
