"""Worker stage: CPU: which native path runs a decode step of few rows, measured on the engine's own steps.

A bf16 CPU model has two native paths for a step of up to decode_layer.MAX_ROWS tokens:
the one-call decoder layer (model/native/fused_decode.py: the whole layer in C) and the layer ops
(model/native/layer_ops.py: the four linear layers through their measured kernels, three native
calls between them). Which is faster depends on the CPU, the model and the row count, so neither
is assumed: for each row bucket (1, 2-4, 5-8, 9-16, 17-20) the first steps alternate
between the two, each path's time per row is recorded, and after TRIALS timed steps of each
the faster one is kept for the bucket (a tie, within TIE_TOLERANCE, keeps the one-call
layer). Each path's first step in a bucket is not counted (it pays for scratch buffers and
cold caches). Real steps are the measurement, so nothing is timed at load and the choice
fits the contexts the engine actually serves; it is made again in each process (a few
steps per bucket).

PAGELLM_DECODE_PATH=fused|layers forces one path (tests, repeatable runs); auto measures.
"""

from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass, field

from pagellm.errors import ConfigError

logger = logging.getLogger(__name__)

FUSED = "fused"
LAYERS = "layers"
FORCE_VARIABLE = "PAGELLM_DECODE_PATH"
BUCKET_EDGES = (1, 4, 8, 16, 20)  # the last row count of each bucket (the linear choice's buckets, up to MAX_ROWS)
TRIALS = 3  # timed steps of each path per bucket
TIE_TOLERANCE = 0.03


def bucket_of(rows: int) -> int:
    for index, edge in enumerate(BUCKET_EDGES):
        if rows <= edge:
            return index
    return len(BUCKET_EDGES) - 1


def forced_path() -> str | None:
    value = os.environ.get(FORCE_VARIABLE, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in (FUSED, LAYERS):
        raise ConfigError(f"{FORCE_VARIABLE}={value!r}: expected auto, fused or layers")
    return value


@dataclass
class _Bucket:
    seconds_per_row: dict[str, list[float]] = field(default_factory=lambda: {FUSED: [], LAYERS: []})
    warmed: set[str] = field(default_factory=set)
    chosen: str | None = None


class StepPathChoice:
    """The path per row bucket: measured on the first steps, then fixed."""

    def __init__(self, forced: str | None = None) -> None:
        self.forced = forced
        self._buckets = [_Bucket() for _ in BUCKET_EDGES]

    def path_for(self, rows: int) -> str:
        """The path the next step of `rows` rows takes (alternating while measuring)."""
        if self.forced is not None:
            return self.forced
        bucket = self._buckets[bucket_of(rows)]
        if bucket.chosen is not None:
            return bucket.chosen
        timed = bucket.seconds_per_row
        return FUSED if len(timed[FUSED]) <= len(timed[LAYERS]) else LAYERS

    def record(self, rows: int, path: str, seconds: float) -> None:
        """The time a step of `rows` rows took on `path`."""
        bucket = self._buckets[bucket_of(rows)]
        if self.forced is not None or bucket.chosen is not None:
            return
        if path not in bucket.warmed:
            bucket.warmed.add(path)
            return
        bucket.seconds_per_row[path].append(seconds / rows)
        fused, layers = bucket.seconds_per_row[FUSED], bucket.seconds_per_row[LAYERS]
        if len(fused) >= TRIALS and len(layers) >= TRIALS:
            faster = statistics.median(layers) < (1 - TIE_TOLERANCE) * statistics.median(fused)
            bucket.chosen = LAYERS if faster else FUSED
            logger.info("decode steps: %s", self.describe())

    def describe(self) -> str:
        """`rows 1: fused (0.41 vs 0.52 ms/row), ...`; buckets still measuring say so."""
        parts = []
        for index, bucket in enumerate(self._buckets):
            first = 1 if index == 0 else BUCKET_EDGES[index - 1] + 1
            label = f"{first}" if first == BUCKET_EDGES[index] else f"{first}-{BUCKET_EDGES[index]}"
            if self.forced is not None:
                parts.append(f"{label} {self.forced} (forced)")
            elif bucket.chosen is None:
                parts.append(f"{label} measuring")
            else:
                fused = statistics.median(bucket.seconds_per_row[FUSED]) * 1e3
                layers = statistics.median(bucket.seconds_per_row[LAYERS]) * 1e3
                parts.append(f"{label} {bucket.chosen} ({fused:.3f} vs {layers:.3f} ms/row)")
        return "rows " + ", ".join(parts)

    def choices(self) -> list[str | None]:
        """Each bucket's path (None while it is measured)."""
        return [self.forced or bucket.chosen for bucket in self._buckets]
