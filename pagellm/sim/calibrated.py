"""Sim stage: a step cost model fitted to steps measured on the real engine.

A step of M tokens (all requests' new tokens together) with D decodes is modelled as

    seconds = base(M) + slope(D) * (KV tokens the decodes read)
              + c_pairs * (prefill attention pairs) + c_sampled * (sampled rows)
              + c_chunk * (prefill chunks)

base and slope are piecewise linear, with knots at 1, 2, ..., 8 and then at powers of
two. Measurements on CPUs show why the per-token cost is not one number: the weight
matmuls of 1 to 7 rows take a row-at-a-time path that costs several times more per row
than the blocked path from 8 rows up (a 7-token step is slower than an 8-token one), and
matmul efficiency keeps improving with M after that. base(M) learns that curve point by
point; slope(D) does the same for decode attention, whose cost per KV token also depends
on how many decodes share the step. The pair, sample and chunk terms carry prefill
attention (quadratic in a chunk), the LM head / sampler / detokenizer per sampled row,
and the per-chunk calls of the prefill attention path.

Engines that run small decode-only steps through a separate path (on CPU in bf16, each
decoder layer as one native call for up to 20 decodes, kernels/decode_layer.py) get a
second base curve, native(D), for decode-only steps of at most `native_decode_max_reqs`
decodes, in place of base(M), and their own cost per KV token read, native_slope(D) on
the same knots: the two paths cost differently at the same token count, and read the
context differently (the native layer prefetches it while the weights stream). With one shared KV-token slope, a
validation run had steps mixing a prefill with decodes 16% slower than predicted and
decode-only steps 6% faster. The calibration records the limit the engine used (0: no
such path).

The fit is non-negative least squares of relative error (every step counts by its own
duration, so the many short decode steps weigh as much as the few long prefills). Knots
without measured steps nearby are left out, so nothing is predicted from an empty
region; beyond the last knot base grows in proportion to M. `pagellm calibrate`
measures the steps and writes the fit as JSON.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.errors import ConfigError
from pagellm.config.model import ModelConfig
from pagellm.core.step_batch import StepBatch

CALIBRATION_FORMAT = "pagellm-step-cost-calibration/5"
# Files of format 3 had no native decode curve; they read as "no native path". Files of
# format 4 had no KV-token cost of their own for native steps: those use slope(D).
READABLE_FORMATS = ("pagellm-step-cost-calibration/3", "pagellm-step-cost-calibration/4", CALIBRATION_FORMAT)
# Candidate knots of base(M) and slope(M): every small batch size, then powers of two.
CANDIDATE_KNOTS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8) + tuple(2**i for i in range(4, 17))
# A knot is kept when this many measured steps lie close to it (hat weight above 1/2).
MIN_STEPS_PER_KNOT = 3
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
    """The fitted curve and coefficients (seconds)."""

    token_knots: tuple[int, ...]  # of base(M)
    base_s: tuple[float, ...]  # step time at each token knot, before the other terms
    decode_knots: tuple[int, ...]  # of slope(D)
    decode_context_s: tuple[float, ...]  # seconds per KV token a decode reads, per decode knot
    prefill_pair_s: float
    sampled_row_s: float
    prefill_chunk_s: float
    quality: FitQuality
    # Decode-only steps of 1..native_decode_max_reqs decodes: base time per decode knot.
    native_decode_max_reqs: int = 0
    native_knots: tuple[int, ...] = ()
    native_base_s: tuple[float, ...] = ()
    native_context_s: tuple[float, ...] = ()  # per KV token in native steps, per native knot; (): slope(D)

    def __post_init__(self) -> None:
        for knots in (self.token_knots, self.decode_knots) + ((self.native_knots,) if self.native_knots else ()):
            if not knots or list(knots) != sorted(set(knots)) or knots[0] < 1:
                raise ConfigError(f"the calibration's knots must be increasing positive integers, got {knots}")
        if (
            len(self.base_s) != len(self.token_knots)
            or len(self.decode_context_s) != len(self.decode_knots)
            or len(self.native_base_s) != len(self.native_knots)
            or len(self.native_context_s) not in (0, len(self.native_knots))
        ):
            raise ConfigError("the calibration needs one value per knot")
        values = (
            *self.base_s, *self.decode_context_s, *self.native_base_s,
            self.prefill_pair_s, self.sampled_row_s, self.prefill_chunk_s,
            *self.native_context_s,
        )  # fmt: skip
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ConfigError("the calibration's costs must be finite and non-negative")


def knot_weights(num_tokens: int, knots: Sequence[int]) -> tuple[int, float, float]:
    """(index i, weight of knot i, weight of knot i + 1) of linear interpolation between
    the two knots around num_tokens; below the first knot all weight is on it, above the
    last it is num_tokens / last (proportional growth), with i + 1 out of range."""
    if num_tokens <= knots[0]:
        return 0, 1.0, 0.0
    last = len(knots) - 1
    if num_tokens >= knots[last]:
        return last, num_tokens / knots[last], 0.0
    i = bisect.bisect_right(knots, num_tokens) - 1
    low, high = knots[i], knots[i + 1]
    t = (num_tokens - low) / (high - low)
    return i, 1.0 - t, t


def takes_native_decode(batch: StepBatch, native_decode_max_reqs: int) -> bool:
    """Whether the engine runs this step on its native decode path."""
    return batch.num_prefills == 0 and 0 < batch.num_decodes <= native_decode_max_reqs


def _design_row(
    batch: StepBatch,
    token_knots: Sequence[int],
    decode_knots: Sequence[int],
    native_knots: Sequence[int] = (),
    native_decode_max_reqs: int = 0,
) -> list[float]:
    """The fit's row: base weights per token knot, native weights per native knot, slope
    weights per decode knot, the pair, sampled-row and chunk terms, then native slope
    weights per native knot."""
    n, p, m = len(token_knots), len(native_knots), len(decode_knots)
    row = [0.0] * (n + p + m + 3 + p)
    native = bool(native_knots) and takes_native_decode(batch, native_decode_max_reqs)
    if native:
        i, w_low, w_high = knot_weights(batch.num_decodes, native_knots)
        i += n
    else:
        i, w_low, w_high = knot_weights(batch.num_tokens, token_knots)
    row[i] = w_low
    if w_high:
        row[i + 1] = w_high
    context = batch.decode_context_sum
    if native:
        j = i + p + m + 3  # native slope columns, on the knots of native(D); no growth past the last
        row[j] = context * min(w_low, 1.0)
        if w_high:
            row[j + 1] = context * w_high
    elif context:
        j, v_low, v_high = knot_weights(batch.num_decodes, decode_knots)
        # The slope does not grow past the last knot: only base scales there.
        row[n + p + j] = context * min(v_low, 1.0)
        if v_high:
            row[n + p + j + 1] = context * v_high
    row[n + p + m] = batch.prefill_attention_pairs
    row[n + p + m + 1] = batch.num_sampled_tokens
    row[n + p + m + 2] = batch.num_prefills
    return row


def supported_knots(sizes: Sequence[int]) -> tuple[int, ...]:
    """The candidate knots with at least MIN_STEPS_PER_KNOT measured sizes near them."""
    counts = [0] * len(CANDIDATE_KNOTS)
    for size in sizes:
        i, w_low, w_high = knot_weights(size, CANDIDATE_KNOTS)
        if w_low > 0.5:
            counts[i] += 1
        if w_high > 0.5:
            counts[i + 1] += 1
    knots = tuple(k for k, c in zip(CANDIDATE_KNOTS, counts) if c >= MIN_STEPS_PER_KNOT)
    if not knots:
        raise ConfigError(f"too few measured steps to fit (need {MIN_STEPS_PER_KNOT} of similar size)")
    return knots


def predict_seconds(fit: StepCostFit, batch: StepBatch) -> float:
    native = bool(fit.native_knots) and takes_native_decode(batch, fit.native_decode_max_reqs)
    if native:
        knots, base = fit.native_knots, fit.native_base_s
        size = batch.num_decodes
    else:
        knots, base, size = fit.token_knots, fit.base_s, batch.num_tokens
    i, w_low, w_high = knot_weights(size, knots)
    seconds = base[i] * w_low
    if w_high:
        seconds += base[i + 1] * w_high
    context = batch.decode_context_sum
    if native and fit.native_context_s:
        slope = fit.native_context_s[i] * min(w_low, 1.0)
        if w_high:
            slope += fit.native_context_s[i + 1] * w_high
        seconds += slope * context
    elif context:
        j, v_low, v_high = knot_weights(len(batch.decode_context_lens), fit.decode_knots)
        slope = fit.decode_context_s[j] * min(v_low, 1.0)
        if v_high:
            slope += fit.decode_context_s[j + 1] * v_high
        seconds += slope * context
    seconds += fit.sampled_row_s * batch.num_sampled_tokens
    if batch.prefill_num_tokens:
        seconds += fit.prefill_pair_s * batch.prefill_attention_pairs
        seconds += fit.prefill_chunk_s * len(batch.prefill_num_tokens)
    return max(MIN_STEP_SECONDS, seconds)


def evaluate(fit: StepCostFit, batches: Sequence[StepBatch], seconds: Sequence[float]) -> FitQuality:
    """How well a fit predicts measured step times."""
    predicted = [predict_seconds(fit, b) for b in batches]
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
    batches: Sequence[StepBatch], seconds: Sequence[float], native_decode_max_reqs: int = 0
) -> StepCostFit:
    """Fit the model to measured steps (see the module docstring); native_decode_max_reqs
    is the engine's limit for its native decode path (0: none)."""
    import numpy as np

    from pagellm.sim.nnls import nnls

    if len(batches) != len(seconds) or not batches:
        raise ConfigError("fitting needs as many measured steps as batches, and at least one")
    if any(not s > 0 for s in seconds):
        raise ConfigError("measured step times must be positive")
    native = [takes_native_decode(b, native_decode_max_reqs) for b in batches]
    token_knots = supported_knots([b.num_tokens for b, on_native in zip(batches, native) if not on_native])
    native_knots = supported_knots([b.num_decodes for b, on_native in zip(batches, native) if on_native]) if any(native) else ()
    # slope(D) only where steps with decodes off the native path were measured (native
    # steps have their own slope); all steps with decodes if there are none such.
    other_decodes = [b.num_decodes for b, on_native in zip(batches, native) if b.num_decodes and not on_native]
    decode_knots = supported_knots(other_decodes or [b.num_decodes for b in batches if b.num_decodes])
    rows = np.array(
        [_design_row(b, token_knots, decode_knots, native_knots, native_decode_max_reqs) for b in batches],
        dtype=np.float64,
    )
    times = np.array(seconds, dtype=np.float64)
    # Columns scaled to comparable magnitudes so the solver's tolerance means the same
    # for all; rows divided by their own time: relative error.
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    x = nnls(rows / scale / times[:, None], np.ones_like(times)) / scale
    n, p, m = len(token_knots), len(native_knots), len(decode_knots)
    provisional = StepCostFit(
        token_knots, tuple(float(v) for v in x[:n]), decode_knots, tuple(float(v) for v in x[n + p : n + p + m]),
        float(x[n + p + m]), float(x[n + p + m + 1]), float(x[n + p + m + 2]), FitQuality(0, 0.0, 0.0, 0.0, 0.0, 0.0),
        native_decode_max_reqs if native_knots else 0, native_knots, tuple(float(v) for v in x[n : n + p]),
        tuple(float(v) for v in x[n + p + m + 3 :]),
    )  # fmt: skip
    return dataclasses.replace(provisional, quality=evaluate(provisional, batches, seconds))


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
        # The largest batches the sweep measured; beyond them the fit extrapolates.
        self._max_tokens = self.metadata.get("max_measured_tokens")
        self._max_chunk = self.metadata.get("max_measured_chunk")
        self._max_reqs = self.metadata.get("max_measured_reqs")

    @property
    def name(self) -> str:
        machine = self.metadata.get("machine", "the measured machine")
        return f"calibrated: {self.model_name} ({self.dtype}) on {machine}"

    def predict(self, batch: StepBatch) -> float:
        return predict_seconds(self.fit, batch)

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
        fit = self.fit
        return {
            "kind": "calibrated",
            "model": self.model_name,
            "dtype": self.dtype,
            "base_ms_at_tokens": {k: round(v * 1e3, 3) for k, v in zip(fit.token_knots, fit.base_s)},
            **(
                {"native_decode_ms_at_decodes": {k: round(v * 1e3, 3) for k, v in zip(fit.native_knots, fit.native_base_s)}}
                if fit.native_knots
                else {}
            ),
            "fit": dataclasses.asdict(fit.quality),
            **{k: v for k, v in self.metadata.items() if k in ("machine", "created")},
        }

    # ------------------------------------------------------------------ JSON file

    def to_json(self) -> dict[str, Any]:
        config = dataclasses.asdict(self.model_config)
        fit = dataclasses.asdict(self.fit)
        quality = fit.pop("quality")
        return {
            "format": CALIBRATION_FORMAT,
            "model_name": self.model_name,
            "model_config": {k: v for k, v in config.items() if k in _SHAPE_FIELDS},
            "dtype": self.dtype,
            "dtype_bytes": self.dtype_bytes,
            "costs": fit,
            "fit": quality,
            "metadata": self.metadata,
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CalibratedCostModel:
        if data.get("format") not in READABLE_FORMATS:
            raise ConfigError(
                f"not a pagellm calibration of this version (format {data.get('format')!r}, "
                f"expected {CALIBRATION_FORMAT!r}); write one with `pagellm calibrate`"
            )
        try:
            config = ModelConfig(**data["model_config"])
            costs = data["costs"]
            fit = StepCostFit(
                tuple(int(k) for k in costs["token_knots"]),
                tuple(float(v) for v in costs["base_s"]),
                tuple(int(k) for k in costs["decode_knots"]),
                tuple(float(v) for v in costs["decode_context_s"]),
                float(costs["prefill_pair_s"]), float(costs["sampled_row_s"]),
                float(costs["prefill_chunk_s"]), FitQuality(**data["fit"]),
                int(costs.get("native_decode_max_reqs", 0)),
                tuple(int(k) for k in costs.get("native_knots", ())),
                tuple(float(v) for v in costs.get("native_base_s", ())),
                tuple(float(v) for v in costs.get("native_context_s", ())),
            )  # fmt: skip
            return cls(
                fit, str(data["model_name"]), config, str(data["dtype"]),
                int(data["dtype_bytes"]), dict(data.get("metadata") or {}),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
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
