"""The measured choice between the one-call decode layer and the layer ops
(worker/step_paths/choice.py), with injected step times, and in a bf16 model's steps."""

from __future__ import annotations

import pytest

from pagellm.errors import ConfigError
from pagellm.worker.step_paths import choice as sp


def run_steps(choice: sp.StepPathChoice, rows: int, seconds: dict[str, float], steps: int) -> list[str]:
    taken = []
    for _ in range(steps):
        path = choice.path_for(rows)
        taken.append(path)
        choice.record(rows, path, seconds[path] * rows)
    return taken


def test_the_faster_path_is_kept_after_alternating():
    choice = sp.StepPathChoice()
    taken = run_steps(choice, 3, {sp.FUSED: 1.0, sp.LAYERS: 0.5}, 20)
    # One warm-up step of each (not counted), then TRIALS timed steps of each, then fixed.
    measuring = 2 * (sp.TRIALS + 1)
    assert taken[:measuring].count(sp.FUSED) == taken[:measuring].count(sp.LAYERS) == sp.TRIALS + 1
    assert set(taken[measuring:]) == {sp.LAYERS}
    assert choice.choices()[sp.bucket_of(3)] == sp.LAYERS
    assert choice.choices()[sp.bucket_of(1)] is None  # other buckets are measured on their own
    assert "2-4 layers (1000.000 vs 500.000 ms/row)" in choice.describe()
    assert choice.describe().startswith("rows 1 measuring, 2-4 layers")


def test_a_tie_keeps_the_one_call_layer():
    choice = sp.StepPathChoice()
    taken = run_steps(choice, 1, {sp.FUSED: 1.0, sp.LAYERS: 0.98}, 12)  # 2% faster: within TIE_TOLERANCE
    assert taken[-1] == sp.FUSED and choice.choices()[0] == sp.FUSED


def test_warm_up_steps_do_not_count():
    # A path whose first step is very slow (buffers, cold caches) but is faster after it.
    choice = sp.StepPathChoice()
    times = {sp.FUSED: [50.0, 1.0, 1.0, 1.0], sp.LAYERS: [1.5, 1.5, 1.5, 1.5]}
    for _ in range(8):
        path = choice.path_for(5)
        choice.record(5, path, times[path].pop(0))
    assert choice.choices()[sp.bucket_of(5)] == sp.FUSED


def test_buckets_and_forcing(monkeypatch):
    assert [sp.bucket_of(r) for r in (1, 2, 4, 5, 8, 9, 16, 17, 20)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    forced = sp.StepPathChoice(sp.LAYERS)
    assert run_steps(forced, 7, {sp.FUSED: 0.1, sp.LAYERS: 9.0}, 10) == [sp.LAYERS] * 10
    assert "(forced)" in forced.describe()
    monkeypatch.setenv(sp.FORCE_VARIABLE, "fused")
    assert sp.forced_path() == sp.FUSED
    monkeypatch.setenv(sp.FORCE_VARIABLE, "auto")
    assert sp.forced_path() is None
    monkeypatch.setenv(sp.FORCE_VARIABLE, "fast")
    with pytest.raises(ConfigError, match="expected auto, fused or layers"):
        sp.forced_path()


def test_a_bf16_model_measures_both_paths_on_its_decode_steps(tmp_path, monkeypatch):
    # The engine's own decode steps: both paths run while a bucket is measured, the outputs
    # stay greedy-consistent, and the choice is fixed afterwards.
    from default_path import native_bf16_kernels_available
    from hf_models import make_tiny_hf_checkpoint

    from pagellm import LLM, SamplingParams

    if not native_bf16_kernels_available():
        pytest.skip("needs the native CPU kernels (x86-64 with AVX2, and a C compiler)")
    monkeypatch.delenv(sp.FORCE_VARIABLE, raising=False)
    # The linear kernels pinned to the native streaming one: measured under load (the suite
    # runs beside other workers) oneDNN could win a one-row bucket of these tiny shapes, and
    # the one-call layer does not take a row count planned on oneDNN.
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming")
    folder = make_tiny_hf_checkpoint(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, disable_log_stats=True)
    measured = llm.engine.runner.step_paths.get("measured")
    assert measured is not None
    ran: list[str] = []
    for name, target in (("fused_decode", measured.fused.fused), ("native_layers", measured.layers.layer_ops)):
        run = target.run

        def counted(hidden, *args, run=run, name=name):  # noqa: ANN001, ANN202
            if hidden.shape[0] == 1:
                ran.append(name)
            return run(hidden, *args)

        target.run = counted
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 30
    assert {"fused_decode", "native_layers"} <= set(ran)  # both measured on one-row steps
    chosen = measured.choice.choices()[0]
    assert chosen in (sp.FUSED, sp.LAYERS)
    expected = "fused_decode" if chosen == sp.FUSED else "native_layers"
    assert ran[-5:] == [expected] * 5  # fixed once measured
