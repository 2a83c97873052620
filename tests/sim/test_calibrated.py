"""The calibrated cost model: the fit recovers known costs; files round-trip and fail cleanly."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from pagellm.errors import ConfigError
from pagellm.sim.calibrated import (
    DEFAULT_FEATURES,
    CalibratedCostModel,
    FitQuality,
    StepCostFit,
    feature_row,
    fit_step_costs,
)
from pagellm.sim.model_presets import get_model_preset
from pagellm.sim.nnls import nnls
from pagellm.sim.step_batch import StepBatch

# Seconds per unit of each feature, in DEFAULT_FEATURES order.
TRUE_COSTS = (0.02, 0.0005, 0.0002, 0.0011, 2e-6, 3e-9)


def random_batches(count: int, seed: int = 0) -> list[StepBatch]:
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        decodes = tuple(rng.randint(1, 800) for _ in range(rng.choice([0, 1, 4, 30, 120])))
        chunks = tuple(rng.randint(2, 512) for _ in range(rng.choice([0, 0, 1, 3])))
        contexts = tuple(rng.choice([0, 0, 64, 300]) for _ in chunks)
        if not decodes and not chunks:
            decodes = (5,)
        sampled = len(decodes) + sum(rng.random() < 0.7 for _ in chunks)
        batches.append(StepBatch(chunks, contexts, decodes, sampled))
    return batches


def true_seconds(batch: StepBatch) -> float:
    return sum(c * x for c, x in zip(TRUE_COSTS, feature_row(batch, DEFAULT_FEATURES)))


def test_the_fit_recovers_exact_costs():
    batches = random_batches(300)
    fit = fit_step_costs(batches, [true_seconds(b) for b in batches])
    assert fit.features == DEFAULT_FEATURES
    assert fit.coefficients_s == pytest.approx(TRUE_COSTS, rel=1e-6)
    assert fit.quality.median_abs_rel_error < 1e-9 and fit.quality.r2 == pytest.approx(1.0)


def test_noise_keeps_coefficients_non_negative_and_close():
    rng = random.Random(1)
    batches = random_batches(400, seed=2)
    seconds = [true_seconds(b) * rng.uniform(0.9, 1.1) for b in batches]
    fit = fit_step_costs(batches, seconds)
    assert all(c >= 0 for c in fit.coefficients_s)
    assert 0.02 < fit.quality.median_abs_rel_error < 0.06  # uniform +-10% noise: median 5%
    assert abs(fit.quality.total_time_rel_error) < 0.03


def test_predict_is_the_dot_product_of_features_and_coefficients():
    fit = StepCostFit(DEFAULT_FEATURES, TRUE_COSTS, FitQuality(1, 1.0, 0.0, 0.0, 0.0, 0.0))
    model = CalibratedCostModel(fit, "m", get_model_preset("SmolLM2-135M").config, "bfloat16", 2)
    # By hand: one decode over 100 tokens and a 10-token chunk over 6 (sampled).
    # 0.02 + 11 tokens * 0.0005 + 2 reqs * 0.0002 + 2 sampled * 0.0011 + 100 * 2e-6
    # + (10*6 + 55) pairs * 3e-9
    batch = StepBatch((10,), (6,), (100,), num_sampled_tokens=2)
    expected = 0.02 + 11 * 0.0005 + 2 * 0.0002 + 2 * 0.0011 + 100 * 2e-6 + 115 * 3e-9
    assert model.predict(batch) == pytest.approx(expected)
    for batch in random_batches(50, seed=5):
        assert model.predict(batch) == pytest.approx(true_seconds(batch))


def test_nnls_matches_brute_force_over_active_sets():
    rng = np.random.default_rng(3)
    for _ in range(20):
        a = rng.normal(size=(30, 4))
        b = rng.normal(size=30)
        x = nnls(a, b)
        best = min(
            (np.linalg.norm(a @ candidate - b), tuple(candidate))
            for mask in itertools.product([0, 1], repeat=4)
            for candidate in [_lstsq_on(a, b, mask)]
            if (candidate >= -1e-12).all()
        )
        assert (x >= 0).all()
        assert np.linalg.norm(a @ x - b) == pytest.approx(best[0], rel=1e-9, abs=1e-12)


def _lstsq_on(a: np.ndarray, b: np.ndarray, mask: tuple[int, ...]) -> np.ndarray:
    x = np.zeros(a.shape[1])
    chosen = np.array(mask, dtype=bool)
    if chosen.any():
        x[chosen] = np.linalg.lstsq(a[:, chosen], b, rcond=None)[0]
    return x


def test_json_round_trip(tmp_path):
    batches = random_batches(100)
    fit = fit_step_costs(batches, [true_seconds(b) for b in batches])
    config = get_model_preset("SmolLM2-135M").config
    model = CalibratedCostModel(fit, "smollm2", config, "bfloat16", 2, {"machine": "test box", "max_measured_tokens": 600})
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
    ('{"format": "pagellm-step-cost-calibration/1", "model_name": "m"}', "incomplete or malformed"),
])
def test_bad_files_are_refused(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        CalibratedCostModel.load(path)


def test_missing_file_and_unknown_feature():
    with pytest.raises(ConfigError, match="cannot read"):
        CalibratedCostModel.load("/nonexistent/fit.json")
    with pytest.raises(ConfigError, match="unknown calibration feature"):
        StepCostFit(("constant", "moon_phase"), (1.0, 2.0), FitQuality(1, 1, 0, 0, 0, 0))


def test_steps_beyond_the_measured_range_are_flagged():
    fit = StepCostFit(DEFAULT_FEATURES, TRUE_COSTS, FitQuality(1, 1.0, 0.0, 0.0, 0.0, 0.0))
    limits = {"max_measured_tokens": 512, "max_measured_chunk": 256, "max_measured_reqs": 64}
    model = CalibratedCostModel(fit, "m", get_model_preset("SmolLM2-135M").config, "bfloat16", 2, limits)
    assert not model.outside_measured_range(StepBatch((256,), (0,), (1,) * 63, 64))
    assert model.outside_measured_range(StepBatch((257,), (0,), (), 1))  # chunk
    assert model.outside_measured_range(StepBatch((), (), (1,) * 65, 65))  # requests
    assert model.outside_measured_range(StepBatch((256, 256), (0, 0), (1,), 3))  # tokens
    unknown = CalibratedCostModel(fit, "m", get_model_preset("SmolLM2-135M").config, "bfloat16", 2)
    assert not unknown.outside_measured_range(StepBatch((5000,), (0,), (), 1))
