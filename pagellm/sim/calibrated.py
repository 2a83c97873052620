"""Simulation stage: a step cost model fitted to steps measured on the real engine.

The step time is modelled as a non-negative combination of features of the batch:

    seconds = c0 + c1 * tokens + c2 * requests + c3 * sampled rows
              + c4 * KV tokens the decodes read + c5 * prefill attention pairs

(a fixed per-step cost; the weight matmuls per token; per-request work in the runner,
sampler and output processing; the LM head, sampler and detokenizer per sampled row;
decode attention over the cache; prefill attention, quadratic in the chunk). The fit
minimizes relative error, so that the many short decode steps count as much as the few
long prefill steps. `pagellm calibrate` measures the steps and writes the fit as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.errors import ConfigError
from pagellm.model.config import ModelConfig
from pagellm.sim.step_batch import StepBatch

CALIBRATION_FORMAT = "pagellm-step-cost-calibration/1"

FEATURES: dict[str, Callable[[StepBatch], float]] = {
    "constant": lambda batch: 1.0,
    "num_tokens": lambda batch: batch.num_tokens,
    "num_reqs": lambda batch: batch.num_reqs,
    "num_sampled_tokens": lambda batch: batch.num_sampled_tokens,
    "decode_context_sum": lambda batch: batch.decode_context_sum,
    "prefill_attention_pairs": lambda batch: batch.prefill_attention_pairs,
}
DEFAULT_FEATURES: tuple[str, ...] = tuple(FEATURES)
# Never predict a step faster than this: the simulated clock must always advance.
MIN_STEP_SECONDS = 1e-6


@dataclass(frozen=True)
class FitQuality:
    num_steps: int
    r2: float  # of the step times (not relative)
    median_abs_rel_error: float
    mean_abs_rel_error: float
    p90_abs_rel_error: float
    total_time_rel_error: float  # (sum of predictions - sum of measurements) / measured


@dataclass(frozen=True)
class StepCostFit:
    features: tuple[str, ...]
    coefficients_s: tuple[float, ...]  # seconds per unit of each feature
    quality: FitQuality

    def __post_init__(self) -> None:
        unknown = [name for name in self.features if name not in FEATURES]
        if unknown:
            raise ConfigError(f"unknown calibration feature(s): {', '.join(unknown)}")
        if len(self.features) != len(self.coefficients_s):
            raise ConfigError("the calibration has a different number of features and coefficients")


def feature_row(batch: StepBatch, features: Sequence[str]) -> list[float]:
    return [float(FEATURES[name](batch)) for name in features]


def evaluate(
    features: Sequence[str], coefficients: Sequence[float], batches: Sequence[StepBatch],
    seconds: Sequence[float],
) -> FitQuality:
    """How well coefficients predict measured step times."""
    predicted = [
        max(MIN_STEP_SECONDS, sum(c * x for c, x in zip(coefficients, feature_row(b, features))))
        for b in batches
    ]
    errors = sorted(abs(p - s) / s for p, s in zip(predicted, seconds))
    mean = sum(seconds) / len(seconds)
    total_sq = sum((s - mean) ** 2 for s in seconds)
    residual_sq = sum((p - s) ** 2 for p, s in zip(predicted, seconds))
    return FitQuality(
        num_steps=len(seconds),
        r2=1.0 - residual_sq / total_sq if total_sq > 0 else math.nan,
        median_abs_rel_error=errors[len(errors) // 2],
        mean_abs_rel_error=sum(errors) / len(errors),
        p90_abs_rel_error=errors[min(len(errors) - 1, int(0.9 * len(errors)))],
        total_time_rel_error=(sum(predicted) - sum(seconds)) / sum(seconds),
    )


def fit_step_costs(
    batches: Sequence[StepBatch],
    seconds: Sequence[float],
    features: Sequence[str] = DEFAULT_FEATURES,
) -> StepCostFit:
    """Non-negative least squares of relative error: each row is divided by its own
    measured time, so a 20 ms step mispredicted by 10 ms weighs as much as a 2 s step
    mispredicted by 1 s."""
    import numpy as np

    from pagellm.sim.nnls import nnls

    if len(batches) != len(seconds) or not batches:
        raise ConfigError("fitting needs as many measured steps as batches, and at least one")
    if any(not s > 0 for s in seconds):
        raise ConfigError("measured step times must be positive")
    rows = np.array([feature_row(b, features) for b in batches], dtype=np.float64)
    times = np.array(seconds, dtype=np.float64)
    # Scale columns to comparable magnitudes so the solver's tolerance means the same
    # for all of them; undo it on the coefficients.
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    weighted = rows / scale / times[:, None]
    coefficients = nnls(weighted, np.ones_like(times)) / scale
    quality = evaluate(features, coefficients.tolist(), batches, seconds)
    return StepCostFit(tuple(features), tuple(float(c) for c in coefficients), quality)


class CalibratedCostModel:
    """StepCostModel from a fit of measured steps (see the module docstring)."""

    def __init__(
        self,
        fit: StepCostFit,
        model_name: str,
        model_config: ModelConfig,
        dtype: str,
        dtype_bytes: int,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.fit = fit
        self.model_name = model_name
        self.model_config = model_config
        self.dtype = dtype
        self.dtype_bytes = dtype_bytes
        self.metadata = dict(metadata or {})
        coefficients = dict(zip(fit.features, fit.coefficients_s))
        assert set(coefficients) <= set(FEATURES), "predict() must know every feature"
        # predict() runs once per simulated step: read plain attributes, not a loop over
        # feature callables.
        self._c_constant = coefficients.get("constant", 0.0)
        self._c_tokens = coefficients.get("num_tokens", 0.0)
        self._c_reqs = coefficients.get("num_reqs", 0.0)
        self._c_sampled = coefficients.get("num_sampled_tokens", 0.0)
        self._c_decode_context = coefficients.get("decode_context_sum", 0.0)
        self._c_prefill_pairs = coefficients.get("prefill_attention_pairs", 0.0)
        # The largest batches the sweep measured; beyond them the fit extrapolates.
        self._max_tokens = self.metadata.get("max_measured_tokens")
        self._max_chunk = self.metadata.get("max_measured_chunk")
        self._max_reqs = self.metadata.get("max_measured_reqs")

    @property
    def name(self) -> str:
        return f"calibrated: {self.model_name} ({self.dtype}) on {self.metadata.get('machine', 'the measured machine')}"

    def predict(self, batch: StepBatch) -> float:
        seconds = self._c_constant + self._c_sampled * batch.num_sampled_tokens
        decodes = batch.decode_context_lens
        if decodes:
            num_decodes = len(decodes)
            seconds += (self._c_tokens + self._c_reqs) * num_decodes
            seconds += self._c_decode_context * sum(decodes)
        if batch.prefill_num_tokens:
            seconds += self._c_reqs * len(batch.prefill_num_tokens)
            seconds += self._c_tokens * sum(batch.prefill_num_tokens)
            seconds += self._c_prefill_pairs * batch.prefill_attention_pairs
        return max(MIN_STEP_SECONDS, seconds)

    def outside_measured_range(self, batch: StepBatch) -> bool:
        """Whether the batch is larger than any the calibration measured (more tokens,
        a longer prefill chunk, or more requests): its prediction is an extrapolation."""
        if self._max_tokens is not None and batch.num_tokens > self._max_tokens:
            return True
        if self._max_reqs is not None and batch.num_reqs > self._max_reqs:
            return True
        return bool(
            self._max_chunk is not None
            and batch.prefill_num_tokens
            and max(batch.prefill_num_tokens) > self._max_chunk
        )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "calibrated",
            "model": self.model_name,
            "dtype": self.dtype,
            "features": list(self.fit.features),
            "coefficients_s": list(self.fit.coefficients_s),
            "fit": dataclasses.asdict(self.fit.quality),
            **{k: v for k, v in self.metadata.items() if k in ("machine", "created")},
        }

    # ------------------------------------------------------------------ JSON file

    def to_json(self) -> dict[str, Any]:
        config = dataclasses.asdict(self.model_config)
        return {
            "format": CALIBRATION_FORMAT,
            "model_name": self.model_name,
            "model_config": {k: v for k, v in config.items() if k in _SHAPE_FIELDS},
            "dtype": self.dtype,
            "dtype_bytes": self.dtype_bytes,
            "features": list(self.fit.features),
            "coefficients_s": list(self.fit.coefficients_s),
            "fit": dataclasses.asdict(self.fit.quality),
            "metadata": self.metadata,
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CalibratedCostModel:
        if data.get("format") != CALIBRATION_FORMAT:
            raise ConfigError(
                f"not a pagellm calibration (format {data.get('format')!r}, expected "
                f"{CALIBRATION_FORMAT!r}); write one with `pagellm calibrate`"
            )
        try:
            config = ModelConfig(**data["model_config"])
            fit = StepCostFit(
                tuple(data["features"]),
                tuple(float(c) for c in data["coefficients_s"]),
                FitQuality(**data["fit"]),
            )
            return cls(
                fit, str(data["model_name"]), config, str(data["dtype"]),
                int(data["dtype_bytes"]), dict(data.get("metadata") or {}),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"the calibration file is incomplete or malformed: {e!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> CalibratedCostModel:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"cannot read the calibration file {path}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"the calibration file {path} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"the calibration file {path} does not hold a JSON object")
        return cls.from_json(data)


# The ModelConfig fields a calibration keeps: the shape (for KV sizes), not the numerics.
_SHAPE_FIELDS = (
    "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings",
)  # fmt: skip
