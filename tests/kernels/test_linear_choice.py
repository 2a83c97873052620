"""The measured choice of linear kernels (kernels/linear_choice.py) with injected timings:
the fastest per bucket, ties, failing candidates, pruning, the budget, the disk cache and
its key, and the forcing variable."""

from __future__ import annotations

import json

import pytest

from pagellm.errors import ConfigError
from pagellm.kernels import linear_choice as lc
from pagellm.kernels.linear_bindings import LinearImpl

S, G, O = LinearImpl.STREAMING, LinearImpl.GEMM, LinearImpl.ONEDNN
SHAPE = lc.LinearShape(3072, 576, ("Q4_1",), (S, G, O))
HEAD = lc.LinearShape(49152, 576, ("Q8_0",), (S, G))


def amx_like(shape: lc.LinearShape, rows: int, impl: LinearImpl) -> float:
    """Seconds per call shaped like the issue's Xeon: streaming flat in rows until it is
    compute-bound, oneDNN with a high fixed cost and a far higher rate."""
    work = 2.0 * rows * shape.n * shape.k
    weight_read = shape.n * shape.k * 2 / 40e9
    return {S: weight_read + work / 150e9, G: 2 * weight_read + work / 200e9, O: 4 * weight_read + work / 2000e9}[impl]


def distinct(values: list) -> list:
    """Values in first-seen order, once each (a close call times its contenders again)."""
    return list(dict.fromkeys(values))


@pytest.fixture(autouse=True)
def _not_forced(monkeypatch):
    monkeypatch.delenv(lc.FORCE_VARIABLE, raising=False)


def test_buckets_and_labels():
    assert [lc.bucket_of(r) for r in (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 256, 257, 4096)] == [
        0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # fmt: skip
    assert [lc.bucket_label(i) for i in range(lc.NUM_BUCKETS)] == [
        "1", "2-4", "5-8", "9-16", "17-32", "33-64", "65-256", "257+"]  # fmt: skip
    # every timed row count lies in its own bucket
    assert [lc.bucket_of(r) for r in lc.TIMED_ROWS] == list(range(lc.NUM_BUCKETS))


def test_fastest_per_bucket_and_the_plan_description():
    choice = lc.measure_choice([SHAPE], amx_like, budget_seconds=10)
    plan = choice.plans[SHAPE.key]
    assert plan.choose(1) is S and plan.choose(4096) is O
    for bucket, times in enumerate(choice.timings[SHAPE.key]):
        valid = {impl: t for impl, t in times.items() if t is not None}
        assert plan.choices[bucket] is min(valid, key=valid.get)
    assert plan.describe().startswith("1") and plan.describe().endswith("+ onednn")
    assert lc.LinearPlan((S, S, S, G, G, O, O, O)).describe() == "1-8 streaming, 9-32 gemm, 33+ onednn"
    assert lc.LinearPlan((G,) * lc.NUM_BUCKETS).describe() == "1+ gemm"


def test_ties_go_to_the_earlier_candidate():
    assert lc.pick_fastest({S: 1.0, G: 1.0, O: 1.0}, (S, G, O)) is S
    assert lc.pick_fastest({S: 1.02, G: 1.0}, (S, G)) is S  # within TIE_TOLERANCE
    assert lc.pick_fastest({S: 1.2, G: 1.0}, (S, G)) is G
    assert lc.pick_fastest({S: None, G: float("nan"), O: 0.0}, (S, G, O)) is None


def test_a_native_kernel_close_to_onednn_wins_for_precision():
    A = LinearImpl.AMX
    # float32 outputs within PRECISION_TOLERANCE of oneDNN's bf16 ones are preferred ...
    assert lc.pick_fastest({S: 3.0, G: 1.08, A: 1.09, O: 1.0}, (S, G, A, O)) is G
    assert lc.pick_fastest({G: 1.2, A: 1.05, O: 1.0}, (G, A, O)) is A
    # ... and never at more than that: the choice stays within 0.9x of the fastest.
    assert lc.pick_fastest({S: 3.0, G: 1.2, O: 1.0}, (S, G, O)) is O
    assert 1 / (1 + lc.PRECISION_TOLERANCE) >= 0.9


def test_a_failing_candidate_is_never_chosen():
    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        if impl is O:
            raise RuntimeError("oneDNN exploded")
        return amx_like(shape, rows, impl)

    choice = lc.measure_choice([SHAPE], timer, budget_seconds=10)
    assert O not in choice.plans[SHAPE.key].choices
    assert all(times[O] is None for times in choice.timings[SHAPE.key])
    with pytest.raises(RuntimeError, match="no linear kernel ran"):
        lc.measure_choice([SHAPE], lambda *a: (_ for _ in ()).throw(RuntimeError("x")), budget_seconds=10)


def test_a_candidate_falling_behind_stops_being_timed():
    calls: list[tuple[int, LinearImpl]] = []

    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        calls.append((rows, impl))
        # streaming 4x and more behind from 24 rows on (two buckets in a row by 48)
        return amx_like(shape, rows, impl) * (3.0 if impl is S and rows >= 24 else 1.0)

    lc.measure_choice([SHAPE], timer, budget_seconds=10)
    streaming_rows = [rows for rows, impl in calls if impl is S]
    assert streaming_rows[0] == 1 and streaming_rows[-1] < lc.TIMED_ROWS[-1]
    assert distinct([rows for rows, impl in calls if impl is O]) == list(lc.TIMED_ROWS)  # never pruned: it gains


def test_a_candidate_far_behind_but_gaining_is_still_timed():
    # oneDNN in float32 on an AVX2 CPU: it widens the weight on every call, 6x behind at one
    # row, and overtakes the native kernels at prefill sizes.
    calls: list[tuple[int, LinearImpl]] = []

    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        calls.append((rows, impl))
        return {S: 15e-6 + 10e-6 * rows, G: 30e-6 + 8e-6 * rows, O: 240e-6 + 2e-6 * rows}[impl]

    choice = lc.measure_choice([SHAPE], timer, budget_seconds=10)
    assert distinct([rows for rows, impl in calls if impl is O]) == list(lc.TIMED_ROWS)
    assert choice.plans[SHAPE.key].choose(512) is O and choice.plans[SHAPE.key].choose(1) is S


def test_one_slow_bucket_prunes_nothing():
    # A timing spike on a shared machine (both AMX users slow at one bucket) must not stop
    # the candidates from being timed, and chosen, at the sizes where they win.
    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        spike = 50.0 if rows == lc.TIMED_ROWS[4] and impl is O else 1.0
        return spike * amx_like(shape, rows, impl)

    choice = lc.measure_choice([SHAPE], timer, budget_seconds=10)
    assert all(times[O] is not None for times in choice.timings[SHAPE.key])
    assert choice.plans[SHAPE.key].choose(4096) is O


def test_a_candidate_too_slow_to_time_is_not_timed_at_larger_buckets():
    # torch's bf16 matmul on an AVX2 CPU: a scalar loop, ~0.2 s per call at one row and
    # linear in rows; timing it at 512 rows would take minutes. The budget (10 s) is never
    # reached by the injected timings, only by the prediction.
    timed: list[tuple[int, LinearImpl]] = []

    def scalar_onednn(shape: lc.LinearShape, rows: int, impl: LinearImpl) -> float:
        timed.append((rows, impl))
        return 0.2 * rows if impl is O else 0.15 * rows  # never 4x behind: only the prediction cuts it

    choice = lc.measure_choice([SHAPE], scalar_onednn, budget_seconds=10)
    onednn_rows = distinct([rows for rows, impl in timed if impl is O])
    assert onednn_rows == [1, 3, 6, 12]  # at 24 rows, 4 calls of ~4.8 s would outlast the budget
    assert all(times[O] is None for times in choice.timings[SHAPE.key][4:])
    # The fastest candidate is always timed, however slow: a choice is made at every bucket.
    assert distinct([rows for rows, impl in timed if impl is S]) == list(lc.TIMED_ROWS)
    assert set(choice.plans[SHAPE.key].choices) == {S}


def test_the_budget_leaves_large_buckets_with_the_last_choice():
    choice = lc.measure_choice([SHAPE, HEAD], amx_like, budget_seconds=0.0)
    for shape in (SHAPE, HEAD):
        plan = choice.plans[shape.key]
        assert len(plan.choices) == lc.NUM_BUCKETS and len(set(plan.choices)) == 1
        assert choice.unmeasured_buckets[shape.key] == list(range(1, lc.NUM_BUCKETS))


def test_cache_round_trip_and_stale_signatures(tmp_path):
    timed = []

    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        timed.append(rows)
        return amx_like(shape, rows, impl)

    signature = {"cpu": "Xeon|x86_64|amx_bf16 avx512f", "threads": 2, "torch": "2.13.0", "kernels": "a.so"}
    first = lc.resolve_choice([SHAPE, HEAD], timer, signature, tmp_path, budget_seconds=10)
    assert first.source == "measured" and timed
    timed.clear()
    again = lc.resolve_choice([SHAPE, HEAD], timer, signature, tmp_path, budget_seconds=10)
    assert again.source == "cache" and not timed and again.plans == first.plans
    # Another CPU (or thread count, torch, kernels) is another file: measured anew.
    for changed in ({"cpu": "EPYC|x86_64|avx512f"}, {"threads": 4}, {"torch": "2.14.0"}, {"kernels": "b.so"}):
        assert lc.resolve_choice([SHAPE], timer, {**signature, **changed}, tmp_path, 10).source == "measured"
    # A file for other shapes, or a corrupted one, is not used.
    path = lc.cache_path(tmp_path, signature, [SHAPE, HEAD])
    record = json.loads(path.read_text())
    record["plans"].pop(HEAD.key)
    path.write_text(json.dumps(record))
    assert lc.load_choice(path, [SHAPE, HEAD]) is None
    path.write_text("{not json")
    assert lc.resolve_choice([SHAPE, HEAD], timer, signature, tmp_path, 10).source == "measured"


def test_forcing_one_implementation(monkeypatch):
    monkeypatch.setenv(lc.FORCE_VARIABLE, "onednn")
    choice = lc.resolve_choice([SHAPE], amx_like, {}, None)
    assert choice.source == "forced" and choice.plans[SHAPE.key].choices == (O,) * lc.NUM_BUCKETS
    monkeypatch.setenv(lc.FORCE_VARIABLE, "auto")
    assert lc.resolve_choice([SHAPE], amx_like, {}, None, budget_seconds=10).source == "measured"
    monkeypatch.setenv(lc.FORCE_VARIABLE, "fastest")
    with pytest.raises(ConfigError, match="PAGELLM_LINEAR_KERNEL='fastest'"):
        lc.resolve_choice([SHAPE], amx_like, {}, None)


def test_a_close_call_is_timed_again_and_one_spike_does_not_decide():
    """oneDNN's first timing in each bucket is disturbed (1.6x its true time) and puts the
    GEMM ahead; timed again in turn, oneDNN's true lead decides."""
    calls: dict[LinearImpl, int] = {S: 0, G: 0, O: 0}
    true_time = {S: 9.0e-4, G: 4.2e-4, O: 2.8e-4}

    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        calls[impl] += 1
        first = (calls[impl] - 1) % (1 + lc.CONFIRM_ROUNDS) == 0
        return true_time[impl] * (1.6 if first and impl is O else 1.0)
        # (noise only slows a timing down: each contender keeps its best)

    shape = lc.LinearShape(576, 576, ("Q4_1",), (S, G, O))
    choice = lc.measure_choice([shape], timer, budget_seconds=10)
    assert set(choice.plans[shape.key].choices) == {O}
    assert calls[S] == lc.NUM_BUCKETS  # never a contender: timed once per bucket
    assert calls[G] == calls[O] == lc.NUM_BUCKETS * (1 + lc.CONFIRM_ROUNDS)
    assert all(times[G] == 4.2e-4 and times[O] == 2.8e-4 for times in choice.timings[shape.key])


def test_a_clear_winner_is_not_timed_again():
    counted = []

    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        counted.append((rows, impl))
        return {S: 1.0, G: 3.0, O: 9.0}[impl]

    lc.measure_choice([SHAPE], timer, budget_seconds=10)
    assert len(counted) == len(set(counted))


def _fake_load_meter(others_cpu_seconds: float, wall_seconds: float = 1.0, own_cpu_seconds: float = 2.0):
    """Readings as on a 2-CPU machine (the test passes num_cpus through os.cpu_count)."""
    readings = iter([
        lc.LoadReading(wall=0.0, own_cpu=0.0, system_busy=100.0),
        lc.LoadReading(wall=wall_seconds, own_cpu=own_cpu_seconds, system_busy=100.0 + own_cpu_seconds + others_cpu_seconds),
    ])  # fmt: skip
    return lambda: next(readings)


def test_a_disturbed_measurement_is_used_but_not_cached(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    signature = {"cpu": "EPYC|x86_64|avx2", "threads": 2}
    busy = lc.resolve_choice([SHAPE], amx_like, signature, tmp_path, 10, load_meter=_fake_load_meter(1.0))
    assert busy.source == "measured" and busy.others_share == pytest.approx(0.5)
    assert "next start measures again" in caplog.text
    assert not list(tmp_path.iterdir())
    quiet = lc.resolve_choice([SHAPE], amx_like, signature, tmp_path, 10, load_meter=_fake_load_meter(0.1))
    assert quiet.source == "measured" and quiet.others_share == pytest.approx(0.05)
    assert lc.resolve_choice([SHAPE], amx_like, signature, tmp_path, 10).source == "cache"


def test_an_unknown_load_is_trusted(tmp_path):
    unknown = iter([lc.LoadReading(0.0, 0.0, None), lc.LoadReading(1.0, 2.0, None)])
    choice = lc.resolve_choice([SHAPE], amx_like, {"cpu": "x"}, tmp_path, 10, load_meter=lambda: next(unknown))
    assert choice.others_share is None and list(tmp_path.iterdir())


def test_a_lag_at_few_rows_prunes_nothing():
    """The Zen 3 case: oneDNN in float32 falls further behind the (flat) streaming kernel
    from 1 to 12 rows and still overtakes the GEMM at 512."""
    zen3_f32 = {1: 596, 3: 753, 6: 900, 12: 1000, 24: 868, 48: 1333, 128: 1622, 512: 2522}
    gemm = {1: 106, 3: 94, 6: 136, 12: 161, 24: 247, 48: 441, 128: 1071, 512: 4077}
    streaming = {1: 57, 3: 65, 6: 94, 12: 153, 24: 274, 48: 529, 128: 1578, 512: 7747}
    F = LinearImpl.ONEDNN_F32

    def timer(shape, rows, impl):  # noqa: ANN001, ANN202
        return {S: streaming, G: gemm, F: zen3_f32}[impl][rows] * 1e-6

    shape = lc.LinearShape(576, 576, ("Q4_1",), (S, G, F))
    choice = lc.measure_choice([shape], timer, budget_seconds=10)
    assert choice.plans[shape.key].choose(512) is F and choice.plans[shape.key].choose(1) is S
