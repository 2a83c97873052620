"""The default CPU path (bfloat16 through the native kernels) against HF transformers in
float32, under every scheduling regime the float32 e2e tests cover.

tests/conftest.py pins float32, so without this file the bf16 kernels (linear, one-call
decode layer, native layer ops) never see chunked prefill, preemption, prefix caching or
n > 1, and are compared only with pagellm's own PyTorch bf16 path. Here each scenario of
tests/default_path.py runs with dtype="bfloat16" and is judged against HF float32 by
teacher-forced top-1 agreement and log-probability bounds derived from bf16 rounding
(see default_path.py for the thresholds and why), and against the same scenario in
pagellm's float32 for the scheduling facts.
"""

import pytest
from hf_models import load_hf_reference

import default_path as dp
from kernel_builds import KERNEL_ISA_LEVELS
from pagellm.kernels.decode_layer import MAX_ROWS

NUM_LAYERS = dp.DEFAULT_PATH_SHAPE["num_hidden_layers"]
VOCAB_SIZE = 256  # hf_models.TINY_SHAPE
SCENARIOS = {s.name: s for s in dp.standard_scenarios(VOCAB_SIZE)}


@pytest.fixture(scope="module", autouse=True)
def _needs_native_bf16():
    if not dp.native_bf16_kernels_available():
        pytest.skip("the default bf16 path needs the native CPU kernels (x86-64 with AVX2, and a C compiler)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = dp.make_default_path_checkpoint(tmp_path_factory.mktemp("default_path"))
    return str(folder), load_hf_reference(folder)


@pytest.fixture(scope="module")
def runs(model):
    """Each (scenario, dtype) runs once for all the tests that look at it."""
    folder, _ = model
    cache: dict[tuple[str, str], dp.ScenarioRun] = {}

    def get(name: str, dtype: str) -> dp.ScenarioRun:
        if (name, dtype) not in cache:
            cache[name, dtype] = dp.run_scenario(folder, SCENARIOS[name], dtype)
        return cache[name, dtype]

    return get


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bf16_agrees_with_hf_float32(model, runs, name):
    _, reference = model
    run = runs(name, "bfloat16")
    dp.check_native_paths(run)
    result = dp.teacher_forced(reference, run.completions)
    print(
        f"{name}: top-1 {result.agreed}/{result.positions} = {result.agreement:.2%}, "
        f"widest mismatch gap {result.max_gap:.4f} (bound {dp.near_tie_bound(NUM_LAYERS, result.logit_scale):.4f}), "
        f"log-prob error max {result.max_logprob_error:.4f} rms {result.rms_logprob_error:.4f}"
    )
    dp.check_against_reference(result, NUM_LAYERS, name)


@pytest.mark.parametrize("kernel", ["streaming", "gemm", "amx", "onednn", "onednn-f32"])
@pytest.mark.parametrize("name", ["plain", "chunked_prefill", "prefix_caching"])
def test_each_forced_linear_kernel_agrees_with_hf_float32(model, runs, name, kernel, monkeypatch):
    # The measured choice may take any of them on some CPU: each one, forced for every linear
    # layer and row count, in the regimes whose steps have different row counts (a batch that
    # shrinks from 24 decodes to one, 16-token chunks, prefills after a cached prefix). A
    # linear kernel computes rows alone: preemption, swap and forks change which rows a step
    # has, which these regimes already vary (the test above runs them all).
    _, reference = model
    folder, _ = model
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", kernel)
    run = dp.run_scenario(folder, SCENARIOS[name], "bfloat16")
    dp.check_native_paths(run)
    if kernel.startswith("onednn"):  # the one-call layer has no oneDNN: every step takes the layer ops
        assert not run.paths.fused_decode
    elif name == "plain":
        # 24 requests of different lengths: decode steps of more than MAX_ROWS requests take
        # the native layer ops, the later smaller ones the one-call decode layer.
        assert run.paths.fused_decode and max(run.paths.fused_decode) <= MAX_ROWS
        assert any(rows > MAX_ROWS for rows in run.paths.native_layers_decode)
    result = dp.teacher_forced(reference, run.completions)
    dp.check_against_reference(result, NUM_LAYERS, f"{name} ({kernel})")
    dp.check_same_schedule(run, runs(name, "float32"))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_layer_ops_for_small_decode_steps_agree_with_hf_float32(model, runs, name, monkeypatch):
    # The measured step-path choice (worker/step_paths/choice.py) may keep the layer ops for small
    # decode steps on some CPU (the one-call layer is what the tests above mostly take):
    # forced, under every scheduling regime.
    _, reference = model
    folder, _ = model
    monkeypatch.setenv("PAGELLM_DECODE_PATH", "layers")
    run = dp.run_scenario(folder, SCENARIOS[name], "bfloat16")
    dp.check_native_paths(run)
    assert not run.paths.fused_decode
    if name == "plain":  # 24 requests: decode steps of every size, down to a few rows
        assert any(rows <= MAX_ROWS for rows in run.paths.native_layers_decode)
    result = dp.teacher_forced(reference, run.completions)
    dp.check_against_reference(result, NUM_LAYERS, f"{name} (layer ops)")
    dp.check_same_schedule(run, runs(name, "float32"))


@pytest.mark.skipif(len(KERNEL_ISA_LEVELS) < 2, reason="the host runs no kernel build below its default one")
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_avx2_build_agrees_with_hf_float32(model, runs, name, monkeypatch):
    # What an AVX2-only CPU runs (float32 arithmetic on bf16 inputs, linear_f32.c, and the
    # generic attention loop), under every scheduling regime, on a host that has more.
    _, reference = model
    folder, _ = model
    monkeypatch.setenv("PAGELLM_KERNEL_ISA", KERNEL_ISA_LEVELS[0])
    run = dp.run_scenario(folder, SCENARIOS[name], "bfloat16")
    dp.check_native_paths(run)
    result = dp.teacher_forced(reference, run.completions)
    dp.check_against_reference(result, NUM_LAYERS, f"{name} ({KERNEL_ISA_LEVELS[0]})")
    dp.check_same_schedule(run, runs(name, "float32"))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bf16_schedules_as_float32(runs, name):
    float32_run = runs(name, "float32")
    assert float32_run.paths is None  # pagellm's exact path: no native bf16 routes
    dp.check_same_schedule(runs(name, "bfloat16"), float32_run)


def test_parallel_greedy_completions_are_equal(runs):
    # n = 3 greedy: the forked completions share the prompt's blocks (copy-on-write of the
    # partial last block) and must decode exactly as completion 0 does.
    run = runs("parallel_sampling", "bfloat16")
    greedy = [c for c in run.completions if c.greedy]
    assert len(greedy) == 6 * 3
    for i in range(0, len(greedy), 3):
        assert greedy[i].token_ids == greedy[i + 1].token_ids == greedy[i + 2].token_ids


def test_prefill_logits_against_hf_float32(model):
    folder, reference = model
    prompts = SCENARIOS["plain"].prompts
    result = dp.prefill_logits(folder, reference, prompts, "bfloat16", VOCAB_SIZE, max_model_len=128)
    print(
        f"prefill logits: max error / spread {max(e / s for e, s in zip(result.errors, result.logit_scales)):.4f} "
        f"(bound {dp.logit_error_bound(NUM_LAYERS, 1.0):.4f}), rms {max(result.relative_errors):.4f} "
        f"(bound {dp.logit_rms_bound(NUM_LAYERS, 1.0):.4f})"
    )
    dp.check_prefill_logits(result, NUM_LAYERS)


def test_a_sliding_window_model_takes_the_native_paths(tmp_path_factory, monkeypatch):
    """Mistral-style: every layer slides over 24 positions (one KV cache group). The native
    layer ops attend within the window; the one-call decode layer runs while every context
    fits in it (then the window hides nothing) and hands the steps past it to the layer
    ops. Short prompts generating 40 tokens cross the window; long ones, chunked, start
    past it. Judged against HF float32."""
    import random

    from pagellm import SamplingParams

    # The one-call layer needs native kernels for every linear: a busy machine's measurement
    # could pick oneDNN for some bucket and keep the steps on the layer ops.
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming")
    folder = dp.make_default_path_checkpoint(tmp_path_factory.mktemp("sliding"), arch="mistral", sliding_window=24)
    reference = load_hf_reference(folder)
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    for prompt_lengths, engine_args in (([2, 3, 5, 8], {}), ([30, 45, 60], {"max_num_batched_tokens": 16})):
        prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in prompt_lengths]
        scenario = dp.Scenario("sliding", prompts, [params] * len(prompts), {"max_model_len": 128, **engine_args})
        run = dp.run_scenario(str(folder), scenario, "bfloat16")
        assert run.paths is not None, "the sliding-window model has no native bf16 routes"
        if prompt_lengths[0] < 24:  # short prompts: the one-call layer may take their prefill too
            assert run.paths.fused_decode, "no decode step took the one-call layer (contexts within the window)"
        else:
            dp.check_native_paths(run)
        assert run.paths.native_layers_decode, "no decode past the window took the layer ops"
        result = dp.teacher_forced(reference, run.completions)
        dp.check_against_reference(result, NUM_LAYERS, f"window 24, prompts {prompt_lengths}")
