"""Kernels stage: CPU: which implementation each linear layer takes, measured on the machine at hand.

What is fastest differs by CPU and by row count (on an AMD Zen 4 pagellm's own GEMM beat
oneDNN at 32-64 rows; on an Intel Xeon with AMX oneDNN is 2-11x faster from 16 rows on,
and the streaming kernel wins at 1-4 rows on both), so no constant decides it. At load,
for every distinct linear shape of the model (out x in features, weight types) and every
row bucket below, each candidate (kernels/linear_bindings.py LinearImpl) is timed at one row count
of the bucket and the fastest kept. The measurement is bounded (`DEFAULT_BUDGET_SECONDS`;
buckets not reached take the last measured bucket's choice and are marked so), and the
result is cached on disk, keyed by everything it depends on: the CPU, the thread count,
the torch version, the compiled kernels, the shapes; unless other processes took a good
share of the CPUs while it ran (kernels/cpu_load.py), so that a busy minute's timings are
not kept for the machine. PAGELLM_LINEAR_KERNEL=streaming|streaming-int8|gemm|
amx|onednn|onednn-f32 forces one implementation everywhere (tests, and repeatable runs; amx where the
CPU has it, else the GEMM; streaming-int8 rounds the activations of Q4_0 / Q4_1 weights to
int8 even where the engine was not asked to).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagellm.errors import ConfigError
from pagellm.kernels.cpu_load import LoadReading, others_share, read_load
from pagellm.kernels.linear_bindings import LinearImpl

logger = logging.getLogger(__name__)

# The largest row count of each bucket; rows above the last edge form one more bucket.
ROW_BUCKET_EDGES = (1, 4, 8, 16, 32, 64, 256)
# The row count each bucket is timed at.
TIMED_ROWS = (1, 3, 6, 12, 24, 48, 128, 512)
NUM_BUCKETS = len(ROW_BUCKET_EDGES) + 1
DEFAULT_BUDGET_SECONDS = 3.0
# A candidate within this fraction of the fastest, and earlier in the candidate order,
# wins: the choice does not flip between runs on timing noise.
TIE_TOLERANCE = 0.03
# A native kernel (float32 output) within this fraction of a faster oneDNN call wins: the
# precision of the default path is worth a few percent of one layer (oneDNN rounds its
# outputs to bf16; benchmarks/precision.py measures what that costs).
PRECISION_TOLERANCE = 0.10
# A candidate this many times slower than the fastest in two buckets in a row is not timed
# in larger buckets (the streaming kernel at prefill sizes).
PRUNE_RATIO = 4.0
# ... judged only from this many rows on: below it the fastest kernel's time is flat in the
# rows and another's fixed cost says nothing of its rate (oneDNN in float32 on a Zen 3: 7-8x
# behind the streaming kernel at 1-3 rows, 1.6x ahead of pagellm's GEMM at 512).
PRUNE_MIN_ROWS = 24
# The two fastest candidates of a bucket within this fraction of each other are timed again,
# in turn, CONFIRM_ROUNDS more times: one disturbed timing of either (the largest buckets get
# one or two calls each) must not decide. On a 2-core Zen 3 a single timing put pagellm's
# GEMM ahead of oneDNN at 512 rows; re-timed, it ran at 0.66 of oneDNN's speed.
CONFIRM_MARGIN = 0.5
CONFIRM_ROUNDS = 2
# A measurement during which other processes used more than this share of all CPUs is
# used for this run but not cached: the next start measures again.
DISTURBED_SHARE = 0.25
# Bumped when the measuring rules change, so that cached choices made under the old ones are redone.
RULES_VERSION = 3
FORCE_VARIABLE = "PAGELLM_LINEAR_KERNEL"
BUDGET_VARIABLE = "PAGELLM_KERNEL_CHOICE_SECONDS"
_CACHE_FORMAT = 1


def bucket_of(rows: int) -> int:
    """The index of the bucket that `rows` falls in."""
    return bisect.bisect_left(ROW_BUCKET_EDGES, rows)


def bucket_label(index: int) -> str:
    """`1`, `2-4`, ..., `257+`."""
    return _rows_label(index, index)


@dataclass(frozen=True)
class LinearShape:
    """What a choice is made for: out_features x in_features, and the stored weight types."""

    n: int
    k: int
    weight_types: tuple[str, ...]  # one label per part: "BF16", "Q4_1", "int8", ...
    candidates: tuple[LinearImpl, ...]  # in order of preference on a tie

    @property
    def key(self) -> str:
        return f"{self.n}x{self.k}:{'+'.join(self.weight_types)}:{','.join(c.label for c in self.candidates)}"


@dataclass(frozen=True)
class LinearPlan:
    """One implementation per row bucket."""

    choices: tuple[LinearImpl, ...]

    def choose(self, rows: int) -> LinearImpl:
        return self.choices[bisect.bisect_left(ROW_BUCKET_EDGES, rows)]

    def describe(self) -> str:
        """`1-8 streaming, 9-16 gemm, 17+ onednn`: runs of buckets with the same choice."""
        runs: list[tuple[int, int, LinearImpl]] = []
        for i, impl in enumerate(self.choices):
            if runs and runs[-1][2] is impl:
                runs[-1] = (runs[-1][0], i, impl)
            else:
                runs.append((i, i, impl))
        return ", ".join(f"{_rows_label(first, last)} {impl.label}" for first, last, impl in runs)


def _lowest_rows(bucket: int) -> int:
    return 1 if bucket == 0 else ROW_BUCKET_EDGES[bucket - 1] + 1


def _rows_label(first: int, last: int) -> str:
    """The row counts of buckets first..last: `9-16`, `17+`, `1`."""
    low = _lowest_rows(first)
    if last == len(ROW_BUCKET_EDGES):
        return f"{low}+"
    high = ROW_BUCKET_EDGES[last]
    return str(low) if low == high else f"{low}-{high}"


# seconds per call of each candidate at one bucket's row count; None: it failed or was not timed
BucketTimes = dict[LinearImpl, float | None]


@dataclass
class LinearChoice:
    """Every shape's plan, the timings behind it, and where it came from."""

    plans: dict[str, LinearPlan]
    timings: dict[str, list[BucketTimes]] = field(default_factory=dict)
    source: str = "measured"  # "measured", "cache" or "forced"
    unmeasured_buckets: dict[str, list[int]] = field(default_factory=dict)  # ran out of budget
    seconds: float = 0.0
    others_share: float | None = None  # share of the CPUs other processes used while measuring


def pick_fastest(times: Mapping[LinearImpl, float | None], order: Sequence[LinearImpl]) -> LinearImpl | None:
    """The fastest candidate (None if none ran); on a near tie the one earlier in `order`;
    a native kernel within PRECISION_TOLERANCE of oneDNN rather than oneDNN."""
    valid = {impl: t for impl, t in times.items() if t is not None and math.isfinite(t) and t > 0}
    if not valid:
        return None
    best = min(valid.values())
    chosen = next(impl for impl in order if impl in valid and valid[impl] <= best * (1 + TIE_TOLERANCE))
    if not chosen.native:
        native = [impl for impl in order if impl in valid and impl.native]
        fastest_native = min(native, key=valid.get, default=None)
        if fastest_native is not None and valid[fastest_native] <= valid[chosen] * (1 + PRECISION_TOLERANCE):
            return fastest_native
    return chosen


def forced_impl() -> LinearImpl | None:
    """The implementation PAGELLM_LINEAR_KERNEL names, or None (choose by measurement)."""
    value = os.environ.get(FORCE_VARIABLE, "").strip().lower()
    if value in ("", "auto"):
        return None
    for impl in LinearImpl:
        if impl is not LinearImpl.BY_ROWS and impl.label == value:
            return impl
    raise ConfigError(
        f"{FORCE_VARIABLE}={value!r}: expected auto, streaming, streaming-int8, gemm, amx, onednn or onednn-f32"
    )


# A timer runs one shape at `rows` rows with `impl` and returns seconds per call (raising
# if the candidate fails).
Timer = Callable[[LinearShape, int, LinearImpl], float]


def measure_choice(shapes: Sequence[LinearShape], timer: Timer, budget_seconds: float) -> LinearChoice:
    """Time every candidate of every shape, bucket by bucket (small buckets first for all
    shapes, so a budget that runs out leaves the decode sizes measured)."""
    start = time.perf_counter()
    deadline = start + budget_seconds
    timings: dict[str, list[BucketTimes]] = {s.key: [] for s in shapes}
    choices: dict[str, list[LinearImpl]] = {s.key: [] for s in shapes}
    unmeasured: dict[str, list[int]] = {}
    pruned: dict[str, set[LinearImpl]] = {s.key: set() for s in shapes}
    for bucket, rows in enumerate(TIMED_ROWS):
        for shape in shapes:
            if time.perf_counter() > deadline and choices[shape.key]:
                choices[shape.key].append(choices[shape.key][-1])
                timings[shape.key].append({})
                unmeasured.setdefault(shape.key, []).append(bucket)
                continue
            times: BucketTimes = {}
            pruned[shape.key] |= _too_long_to_time(timings[shape.key], bucket, pruned[shape.key], deadline)
            for impl in shape.candidates:
                if impl in pruned[shape.key]:
                    times[impl] = None
                    continue
                try:
                    times[impl] = timer(shape, rows, impl)
                except Exception as error:  # a candidate that fails is not chosen, and said
                    logger.warning("linear kernel %s failed on %s at %d rows: %s", impl.label, shape.key, rows, error)
                    times[impl] = None
            _confirm_close_calls(times, shape, rows, timer)
            chosen = pick_fastest(times, shape.candidates)
            if chosen is None:
                raise RuntimeError(f"no linear kernel ran for {shape.key} at {rows} rows")
            if bucket > 0 and TIMED_ROWS[bucket - 1] >= PRUNE_MIN_ROWS:
                _prune_falling_behind(times, timings[shape.key][-1], pruned[shape.key])
            timings[shape.key].append(times)
            choices[shape.key].append(chosen)
    plans = {key: LinearPlan(tuple(c)) for key, c in choices.items()}
    return LinearChoice(plans, timings, "measured", unmeasured, time.perf_counter() - start)


def _confirm_close_calls(times: BucketTimes, shape: LinearShape, rows: int, timer: Timer) -> None:
    """Time the two fastest candidates again, alternately, when they are within
    CONFIRM_MARGIN of each other; each keeps its best time."""
    ranked = sorted((t, impl) for impl, t in times.items() if t is not None)
    if len(ranked) < 2 or ranked[1][0] > ranked[0][0] * (1 + CONFIRM_MARGIN):
        return
    contenders = [ranked[0][1], ranked[1][1]]
    for _ in range(CONFIRM_ROUNDS):
        for impl in contenders:
            try:
                seconds = timer(shape, rows, impl)
            except Exception:  # it ran once already: keep that time
                continue
            times[impl] = min(seconds, times[impl] or math.inf)


def _too_long_to_time(
    earlier: list[BucketTimes], bucket: int, pruned: set[LinearImpl], deadline: float
) -> set[LinearImpl]:
    """The candidates whose timing at this bucket (a few calls) would take more than the
    budget left, predicted from their last timed bucket scaled by the rows; never the one
    predicted fastest. A candidate with no fast path on this CPU (torch's bf16 matmul
    without AVX-512 BF16 or AMX falls back to a scalar loop: seconds per call at prefill
    sizes) must not hold the load up for minutes."""
    predicted: dict[LinearImpl, float] = {}
    for index in range(bucket - 1, -1, -1):
        for impl, seconds in earlier[index].items():
            if seconds is not None and impl not in pruned and impl not in predicted:
                predicted[impl] = seconds * TIMED_ROWS[bucket] / TIMED_ROWS[index]
    if not predicted:
        return set()
    fastest = min(predicted, key=predicted.__getitem__)
    left = deadline - time.perf_counter()
    return {impl for impl, seconds in predicted.items() if impl is not fastest and 4 * seconds > left}


def _prune_falling_behind(times: BucketTimes, previous: BucketTimes, pruned: set[LinearImpl]) -> None:
    """Stop timing a candidate PRUNE_RATIO behind the fastest in this bucket and the one
    before, and not closing the gap: one slow bucket (a timing spike on a shared machine)
    prunes nothing, nor does a high fixed cost that more rows amortize (oneDNN in float32
    widens the weight per call: 6x behind at one row on an AVX2 CPU, ahead from 128)."""
    for impl in times:
        now, before = _lag(times, impl), _lag(previous, impl)
        if now is not None and before is not None and now >= PRUNE_RATIO and before >= PRUNE_RATIO and now >= before:
            pruned.add(impl)


def _lag(times: BucketTimes, impl: LinearImpl) -> float | None:
    """How many times slower than the fastest `impl` was in one bucket (None: not timed)."""
    valid = [t for t in times.values() if t is not None]
    t = times.get(impl)
    return None if t is None or not valid or min(valid) <= 0 else t / min(valid)


def forced_choice(shapes: Sequence[LinearShape], impl: LinearImpl) -> LinearChoice:
    plans = {s.key: LinearPlan((impl,) * NUM_BUCKETS) for s in shapes}
    return LinearChoice(plans, {}, "forced")


# ------------------------------------------------------------------ the cache on disk


def cache_path(cache_dir: Path, signature: Mapping[str, object], shapes: Sequence[LinearShape]) -> Path:
    """The file for this machine, software and set of shapes."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"format": _CACHE_FORMAT, "rows": TIMED_ROWS, **signature}, sort_keys=True).encode())
    for key in sorted(s.key for s in shapes):
        digest.update(key.encode())
    return cache_dir / f"linear_choice_{digest.hexdigest()[:20]}.json"


def save_choice(path: Path, choice: LinearChoice) -> None:
    record = {
        "plans": {key: [impl.label for impl in plan.choices] for key, plan in choice.plans.items()},
        "timings": {
            key: [{impl.label: t for impl, t in times.items()} for times in buckets]
            for key, buckets in choice.timings.items()
        },
        "unmeasured_buckets": choice.unmeasured_buckets,
        "seconds": choice.seconds,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # concurrent processes never read half a file


def load_choice(path: Path, shapes: Sequence[LinearShape]) -> LinearChoice | None:
    """The cached choice, or None when absent, unreadable or not for these shapes."""
    by_label = {impl.label: impl for impl in LinearImpl}
    try:
        record = json.loads(path.read_text())
        plans = {key: LinearPlan(tuple(by_label[label] for label in labels)) for key, labels in record["plans"].items()}
        timings = {
            key: [{by_label[label]: t for label, t in times.items()} for times in buckets]
            for key, buckets in record["timings"].items()
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if set(plans) != {s.key for s in shapes} or any(len(p.choices) != NUM_BUCKETS for p in plans.values()):
        return None
    unmeasured = {key: list(value) for key, value in record.get("unmeasured_buckets", {}).items()}
    return LinearChoice(plans, timings, "cache", unmeasured, float(record.get("seconds", 0.0)))


def resolve_choice(
    shapes: Sequence[LinearShape],
    timer: Timer,
    signature: Mapping[str, object],
    cache_dir: Path | None,
    budget_seconds: float | None = None,
    load_meter: Callable[[], LoadReading] = read_load,
) -> LinearChoice:
    """Forced, cached, or measured now (and cached unless other processes took more than
    DISTURBED_SHARE of the CPUs meanwhile) — in that order."""
    impl = forced_impl()
    if impl is not None:
        return forced_choice(shapes, impl)
    path = cache_path(cache_dir, signature, shapes) if cache_dir is not None else None
    if path is not None:
        cached = load_choice(path, shapes)
        if cached is not None:
            return cached
    if budget_seconds is None:
        budget_seconds = float(os.environ.get(BUDGET_VARIABLE, DEFAULT_BUDGET_SECONDS))
    before = load_meter()
    choice = measure_choice(shapes, timer, budget_seconds)
    choice.others_share = others_share(before, load_meter())
    if choice.others_share is not None and choice.others_share > DISTURBED_SHARE:
        logger.warning(
            "other processes used %.0f%% of the CPUs while the linear kernels were measured: "
            "this run uses the choice, the next start measures again", 100 * choice.others_share)
    elif path is not None:
        try:
            save_choice(path, choice)
        except OSError as error:
            logger.warning("could not cache the linear kernel choice in %s: %s", path, error)
    return choice
