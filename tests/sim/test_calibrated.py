"""The calibrated cost model: the fit recovers known costs; files round-trip and fail cleanly."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from pagellm.errors import ConfigError
from pagellm.sim.calibrated import (
    CalibratedCostModel,
    FitQuality,
    StepCostFit,
    fit_step_costs,
    knot_weights,
    predict_seconds,
    supported_knots,
)
from pagellm.sim.model_presets import get_model_preset
from pagellm.sim.nnls import nnls
from pagellm.core.step_batch import StepBatch

NO_QUALITY = FitQuality(1, 1.0, 0.0, 0.0, 0.0, 0.0)
SMOL = get_model_preset("SmolLM2-135M").config


def true_base(num_tokens: int) -> float:
    """A made-up machine: 20 ms, +2 ms per row up to 7 rows, a cheaper blocked path from 8
    rows (24 ms + 0.5 ms per row beyond 8); decode attention 4 us per KV token with fewer
    than 8 decodes, 1.5 us from 8."""
    if num_tokens < 8:
        return 0.020 + 0.002 * (num_tokens - 1)
    return 0.024 + 0.0005 * (num_tokens - 8)


def true_seconds(batch: StepBatch) -> float:
    slope = 4e-6 if batch.num_decodes < 8 else 1.5e-6
    return (true_base(batch.num_tokens) + slope * batch.decode_context_sum
            + 1e-6 * batch.prefill_attention_pairs + 1e-4 * batch.num_sampled_tokens
            + 1e-3 * batch.num_prefills)  # fmt: skip


def sweep_like_batches(seed: int = 0) -> list[StepBatch]:
    """Decode batches of every size at the knots and prefill/mixed steps, as the sweep makes."""
    rng = random.Random(seed)
    batches = []
    for size in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256):
        for context in (20, 300, 800):
            batches.append(StepBatch((), (), tuple(context + rng.randint(0, 9) for _ in range(size)), size))
    for _ in range(250):
        # Prompts chunked in among 0 to 40 running decodes, as the sweep's mixed traffic.
        decodes = tuple(rng.randint(1, 600) for _ in range(rng.choice([0, 1, 2, 3, 5, 8, 12, 16, 40])))
        chunks = tuple(rng.randint(16, 400) for _ in range(rng.choice([1, 2])))
        contexts = tuple(rng.choice([0, 0, 100]) for _ in chunks)
        batches.append(StepBatch(chunks, contexts, decodes, len(decodes) + 1))
    return batches


def test_knot_weights_interpolate_and_extrapolate():
    knots = (1, 2, 4, 8)
    assert knot_weights(1, knots) == (0, 1.0, 0.0)
    assert knot_weights(3, knots) == (1, 0.5, 0.5)
    assert knot_weights(6, knots) == (2, 0.5, 0.5)
    assert knot_weights(8, knots) == (3, 1.0, 0.0)
    assert knot_weights(16, knots) == (3, 2.0, 0.0)  # proportional beyond the last knot


def test_prediction_by_hand():
    fit = StepCostFit((1, 8, 16), (0.020, 0.024, 0.028), (1, 4, 16), (4e-6, 2e-6, 1e-6), 1e-6, 1e-4, 1e-3, NO_QUALITY)
    # 12 tokens sit halfway between token knots 8 and 16: base 26 ms. Two decodes sit a
    # third of the way from decode knot 1 to 4: slope 2/3 * 4 + 1/3 * 2 = 3.333 us per KV
    # token, over 100 + 300 = 400. One 10-token chunk over nothing cached (55 pairs), three
    # sampled rows, one chunk.
    batch = StepBatch((10,), (0,), (100, 300), num_sampled_tokens=3)
    expected = 0.026 + (4e-6 * 2 / 3 + 2e-6 / 3) * 400 + 1e-6 * 55 + 1e-4 * 3 + 1e-3
    assert predict_seconds(fit, batch) == pytest.approx(expected)
    # 32 decodes: beyond the last token knot base doubles; the slope stays at its last knot.
    big = StepBatch((), (), (10,) * 32, num_sampled_tokens=32)
    assert predict_seconds(fit, big) == pytest.approx(0.056 + 1e-6 * 320 + 1e-4 * 32)


def test_the_fit_recovers_a_known_machine_including_the_small_batch_cliff():
    batches = sweep_like_batches()
    fit = fit_step_costs(batches, [true_seconds(b) for b in batches])
    assert fit.token_knots[:8] == (1, 2, 3, 4, 5, 6, 7, 8)
    # Exact up to the largest steps, where the made-up base is affine and the model grows
    # proportionally past its last knot: least squares spreads that small misfit.
    for knot, base in zip(fit.token_knots, fit.base_s):
        if knot <= 256:
            assert base == pytest.approx(true_base(knot), rel=0.02), knot
    assert fit.prefill_pair_s == pytest.approx(1e-6, rel=0.05)
    # A 7-row step costs more than an 8-row one, as on the made-up machine.
    seven = StepBatch((), (), (100,) * 7, 7)
    eight = StepBatch((), (), (100,) * 8, 8)
    assert predict_seconds(fit, seven) > predict_seconds(fit, eight)
    assert predict_seconds(fit, seven) == pytest.approx(true_seconds(seven), rel=0.01)
    assert fit.quality.median_abs_rel_error < 0.01


def test_noise_keeps_costs_non_negative_and_totals_close():
    rng = random.Random(1)
    batches = sweep_like_batches(seed=2)
    fit = fit_step_costs(batches, [true_seconds(b) * rng.uniform(0.9, 1.1) for b in batches])
    assert all(v >= 0 for v in (*fit.base_s, *fit.decode_context_s))
    assert 0.02 < fit.quality.median_abs_rel_error < 0.07
    assert abs(fit.quality.total_time_rel_error) < 0.03


def test_native_decode_curve_by_hand_and_recovered():
    # A made-up engine whose decode-only steps of up to 32 decodes take a native path:
    # 3 ms + 0.2 ms per decode instead of base(M); everything else as before.
    def native_true(batch: StepBatch) -> float:
        if batch.num_prefills == 0 and 0 < batch.num_decodes <= 32:
            slope = 4e-6 if batch.num_decodes < 8 else 1.5e-6
            return 0.003 + 0.0002 * batch.num_decodes + slope * batch.decode_context_sum + 1e-4 * batch.num_sampled_tokens
        return true_seconds(batch)

    batches = sweep_like_batches()
    fit = fit_step_costs(batches, [native_true(b) for b in batches], native_decode_max_reqs=32)
    assert fit.native_decode_max_reqs == 32 and fit.native_knots[-1] == 32
    for decodes in (1, 5, 16, 32):
        step = StepBatch((), (), (300,) * decodes, decodes)
        assert predict_seconds(fit, step) == pytest.approx(native_true(step), rel=0.02), decodes
    # 33 decodes and any step with a prefill stay on base(M).
    for step in (StepBatch((), (), (300,) * 64, 64), StepBatch((40,), (0,), (300,) * 4, 5)):
        assert predict_seconds(fit, step) == pytest.approx(true_seconds(step), rel=0.03)
    # Without the native curve the same measurements cannot be fitted as well.
    plain = fit_step_costs(batches, [native_true(b) for b in batches])
    assert plain.native_knots == () and plain.quality.median_abs_rel_error > 3 * fit.quality.median_abs_rel_error
    # By hand: 3 decodes sit between native knots 2 and 4.
    by_hand = StepCostFit((1,), (0.5,), (1,), (0.0,), 0.0, 1e-3, 0.0, NO_QUALITY, 8, (2, 4), (0.010, 0.020))
    assert predict_seconds(by_hand, StepBatch((), (), (5, 5, 5), 3)) == pytest.approx(0.015 + 3e-3)
    assert predict_seconds(by_hand, StepBatch((), (), (5,) * 9, 9)) == pytest.approx(0.5 * 9 + 9e-3)


def test_native_steps_read_the_context_at_their_own_cost():
    # A made-up engine whose native decode steps read a KV token at 1 us, while the same
    # decodes beside a prefill (the other path) cost 4 / 1.5 us as in true_seconds: one
    # shared slope would be wrong for one kind or the other.
    def two_paths(batch: StepBatch) -> float:
        if batch.num_prefills == 0 and 0 < batch.num_decodes <= 32:
            return 0.003 + 0.0002 * batch.num_decodes + 1e-6 * batch.decode_context_sum + 1e-4 * batch.num_sampled_tokens
        return true_seconds(batch)

    batches = sweep_like_batches()
    fit = fit_step_costs(batches, [two_paths(b) for b in batches], native_decode_max_reqs=32)
    assert len(fit.native_context_s) == len(fit.native_knots)
    assert fit.native_context_s == pytest.approx([1e-6] * len(fit.native_knots), rel=0.2)
    for step in (
        StepBatch((), (), (50,) * 4, 4), StepBatch((), (), (800,) * 4, 4), StepBatch((), (), (600,) * 24, 24),
        StepBatch((200,), (0,), (500,) * 12, 13), StepBatch((100,), (0,), (40,) * 3, 4),
    ):  # fmt: skip
        assert predict_seconds(fit, step) == pytest.approx(two_paths(step), rel=0.05), step
    # By hand: 3 decodes of 5 tokens each on the native curve, 1e-4 s per KV token.
    by_hand = StepCostFit((1,), (0.5,), (1,), (0.0,), 0.0, 1e-3, 0.0, NO_QUALITY, 8, (2, 4), (0.010, 0.020), (1e-4, 3e-4))
    assert predict_seconds(by_hand, StepBatch((), (), (5, 5, 5), 3)) == pytest.approx(0.015 + 3e-3 + 2e-4 * 15)
    # Format-4 files have no such cost: their native steps keep slope(D).
    data = CalibratedCostModel(fit, "SmolLM2-135M", SMOL, "bfloat16", 2).to_json()
    data["format"] = "pagellm-step-cost-calibration/4"
    del data["costs"]["native_context_s"]
    old = CalibratedCostModel.from_json(data).fit
    step = StepBatch((), (), (300,) * 4, 4)
    assert old.native_context_s == ()

    def slope_at(decodes: int, knots: tuple[int, ...], values: tuple[float, ...]) -> float:
        i, w_low, w_high = knot_weights(decodes, knots)
        return values[i] * min(w_low, 1.0) + (values[i + 1] * w_high if w_high else 0.0)

    shared = slope_at(4, old.decode_knots, old.decode_context_s)
    own = slope_at(4, fit.native_knots, fit.native_context_s)
    assert predict_seconds(old, step) == pytest.approx(predict_seconds(fit, step) + (shared - own) * 1200)


def test_format_3_files_still_load_without_the_native_curve(tmp_path):
    batches = sweep_like_batches()
    model = CalibratedCostModel(fit_step_costs(batches, [true_seconds(b) for b in batches]), "SmolLM2-135M", SMOL, "bfloat16", 2)
    data = model.to_json()
    data["format"] = "pagellm-step-cost-calibration/3"
    for key in ("native_decode_max_reqs", "native_knots", "native_base_s", "native_context_s"):
        del data["costs"][key]
    loaded = CalibratedCostModel.from_json(data)
    assert loaded.fit.native_knots == () and loaded.predict(batches[0]) == model.predict(batches[0])


def test_knots_without_nearby_steps_are_left_out():
    sizes = [1, 1, 1, 8, 8, 8, 64, 64, 60]
    assert supported_knots(sizes) == (1, 8, 64)
    with pytest.raises(ConfigError, match="too few measured steps"):
        supported_knots(sizes[:2])


def test_nnls_matches_brute_force_over_active_sets():
    rng = np.random.default_rng(3)
    for _ in range(20):
        a = rng.normal(size=(30, 4))
        b = rng.normal(size=30)
        x = nnls(a, b)
        best = min(
            float(np.linalg.norm(a @ candidate - b))
            for mask in itertools.product([0, 1], repeat=4)
            for candidate in [_lstsq_on(a, b, mask)]
            if (candidate >= -1e-12).all()
        )
        assert (x >= 0).all()
        assert np.linalg.norm(a @ x - b) == pytest.approx(best, rel=1e-9, abs=1e-12)


def _lstsq_on(a: np.ndarray, b: np.ndarray, mask: tuple[int, ...]) -> np.ndarray:
    x = np.zeros(a.shape[1])
    chosen = np.array(mask, dtype=bool)
    if chosen.any():
        x[chosen] = np.linalg.lstsq(a[:, chosen], b, rcond=None)[0]
    return x


def test_json_round_trip(tmp_path):
    batches = sweep_like_batches()
    fit = fit_step_costs(batches, [true_seconds(b) for b in batches])
    model = CalibratedCostModel(fit, "smollm2", SMOL, "bfloat16", 2, {"machine": "test box", "max_measured_tokens": 600})
    path = tmp_path / "fit.json"
    model.save(path)
    loaded = CalibratedCostModel.load(path)
    assert loaded.fit == model.fit and loaded.model_config.hidden_size == 576
    assert loaded.predict(batches[0]) == model.predict(batches[0])
    assert "test box" in loaded.name


@pytest.mark.parametrize("content,message", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"format": "other"}', "not a pagellm calibration"),
    ('{"format": "pagellm-step-cost-calibration/3", "model_name": "m"}', "incomplete or malformed"),
])  # fmt: skip
def test_bad_files_are_refused(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        CalibratedCostModel.load(path)


def test_bad_fits_and_missing_files():
    with pytest.raises(ConfigError, match="cannot read"):
        CalibratedCostModel.load("/nonexistent/fit.json")
    with pytest.raises(ConfigError, match="increasing"):
        StepCostFit((8, 1), (0.0, 0.0), (1,), (0.0,), 0.0, 0.0, 0.0, NO_QUALITY)
    with pytest.raises(ConfigError, match="one value per knot"):
        StepCostFit((1, 8), (0.0, 0.0), (1,), (0.0, 0.0), 0.0, 0.0, 0.0, NO_QUALITY)
    with pytest.raises(ConfigError, match="non-negative"):
        StepCostFit((1,), (-1.0,), (1,), (0.0,), 0.0, 0.0, 0.0, NO_QUALITY)


def test_steps_beyond_the_measured_range_are_flagged():
    fit = StepCostFit((1,), (0.02,), (1,), (0.0,), 0.0, 0.0, 0.0, NO_QUALITY)
    limits = {"max_measured_tokens": 512, "max_measured_chunk": 256, "max_measured_reqs": 64}
    model = CalibratedCostModel(fit, "m", SMOL, "bfloat16", 2, limits)
    assert not model.outside_measured_range(StepBatch((256,), (0,), (1,) * 63, 64))
    assert model.outside_measured_range(StepBatch((257,), (0,), (), 1))  # chunk
    assert model.outside_measured_range(StepBatch((), (), (1,) * 65, 65))  # requests
    assert model.outside_measured_range(StepBatch((256, 256), (0, 0), (1,), 3))  # tokens
    unknown = CalibratedCostModel(fit, "m", SMOL, "bfloat16", 2)
    assert not unknown.outside_measured_range(StepBatch((5000,), (0,), (), 1))
