"""`pagellm bench serve`: arrival schedule, chunk parsing, aggregation, and real runs
against a `pagellm serve` process on a tiny model (and against a closed port)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import signal
import socket
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import ServerProcess, engine_cli_flags

from pagellm.bench import serve as bench_serve
from pagellm.bench.serve_load import (
    ServeBenchConfig,
    carries_tokens,
    normalize_base_url,
    request_body,
)
from pagellm.bench.serve_metrics import (
    RequestRecord,
    meets_slos,
    parse_goodput_slos,
    summarize,
)
from pagellm.entrypoints.cli import main
from pagellm.errors import ConfigError
from pagellm.workload.arrivals import arrival_times
from pagellm.workload.latency import describe_ms, percentile

# ---------------------------------------------------------------- arrival schedule


def test_poisson_arrivals_have_the_asked_mean_rate() -> None:
    rate, n = 20.0, 4001
    times = arrival_times(n, rate, burstiness=1.0, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential gaps: mean 1/rate, standard deviation 1/rate; the mean of 4000 gaps
    # is within 5 standard errors of 1/rate (standard error = 1/rate/sqrt(4000)).
    mean_gap = statistics.fmean(gaps)
    assert abs(mean_gap - 1 / rate) < 5 * (1 / rate) / math.sqrt(len(gaps))
    # Coefficient of variation of an exponential is 1.
    assert 0.9 < statistics.stdev(gaps) / mean_gap < 1.1
    assert arrival_times(n, rate, seed=7) == times  # deterministic
    assert arrival_times(n, rate, seed=8) != times


def test_gamma_burstiness_keeps_the_rate_and_changes_the_spread() -> None:
    rate, n = 10.0, 4001
    for shape in (0.25, 4.0):
        times = arrival_times(n, rate, shape, seed=1)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean_gap = statistics.fmean(gaps)
        # Gamma(shape, 1/(rate*shape)): mean 1/rate, coefficient of variation 1/sqrt(shape).
        standard_error = (1 / rate) / math.sqrt(shape) / math.sqrt(len(gaps))
        assert abs(mean_gap - 1 / rate) < 5 * standard_error
        cv = statistics.stdev(gaps) / mean_gap
        assert abs(cv - 1 / math.sqrt(shape)) < 0.15 / math.sqrt(shape), (shape, cv)


def test_infinite_rate_sends_everything_at_once_and_bad_values_are_refused() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 3.0) == []
    assert arrival_times(1, 3.0) == [0.0]
    for rate, shape in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)):
        with pytest.raises(ConfigError):
            arrival_times(3, rate, shape)


# ---------------------------------------------------------------- requests and chunks


def test_request_body_and_base_url() -> None:
    config = ServeBenchConfig(
        base_url="http://h:1", model="m", extra_body={"temperature": 0}
    )
    body = request_body(config, [5, 6, 7], 9)
    assert body == {
        "model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0,
    }  # fmt: skip
    chat = ServeBenchConfig(base_url="http://h:1", endpoint="chat")
    assert request_body(chat, "hi", 3)["messages"] == [{"role": "user", "content": "hi"}]
    assert chat.url == "http://h:1/v1/chat/completions"
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    with pytest.raises(ConfigError):
        normalize_base_url("h:8000")


def test_which_chunks_carry_tokens() -> None:
    def comp(text: str | None, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    def chat(delta: dict, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    assert carries_tokens(comp("ab"), "completions")
    assert carries_tokens(comp("x", "length"), "completions")
    assert carries_tokens(comp(""), "completions")  # a token inside a UTF-8 character
    assert not carries_tokens(comp("", "length"), "completions")  # closing chunk only
    assert not carries_tokens({"choices": [], "usage": {"completion_tokens": 3}}, "completions")
    assert not carries_tokens(chat({"role": "assistant", "content": ""}), "chat")
    assert carries_tokens(chat({"content": "hi"}), "chat")
    assert not carries_tokens(chat({}, "stop"), "chat")


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def token(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


@pytest.mark.parametrize(
    ("status", "stream", "success", "output_tokens", "error_start"),
    [
        # Usage in the last chunk wins over counting chunks (2 chunks here, 3 tokens).
        (200, sse(token("a"), token("bc", "length"),
                  {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
                  b"[DONE]"), True, 3, None),
        (200, sse(token("a"), token("b"), token("", "length"), b"[DONE]"), True, 2, None),
        (200, sse(token("a"), {"error": {"message": "engine died", "code": 500}}, b"[DONE]"),
         False, 1, "error in stream: engine died"),
        (200, sse(b"[DONE]"), False, 0, "the stream ended without any generated token"),
        (200, b"data: {not json\n\n", False, 0, "malformed stream chunk"),
        (503, json.dumps({"error": {"message": "too many requests queued"}}).encode(),
         False, 0, "HTTP 503: too many requests queued"),
        (404, b"<html>nope</html>", False, 0, "HTTP 404: <html>nope</html>"),
    ],
)  # fmt: skip
def test_one_request_against_a_fake_server(
    status: int, stream: bytes, success: bool, output_tokens: int, error_start: str | None
) -> None:
    import httpx2

    from pagellm.bench.serve_load import send_request

    seen: list[dict] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(json.loads(request.content))
        assert request.headers["authorization"] == "Bearer k"
        return httpx2.Response(status, content=stream)

    config = ServeBenchConfig(base_url="http://fake", api_key="k")
    r = RequestRecord(index=0, prompt_len=4, expected_output_len=3, scheduled_s=0.0)

    async def go() -> None:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(handler)) as client:
            await send_request(client, config, r, request_body(config, [1, 2, 3, 4], 3), 0.0)

    asyncio.run(go())
    assert seen[0]["prompt"] == [1, 2, 3, 4] and seen[0]["max_tokens"] == 3
    assert r.success is success and r.output_tokens == output_tokens
    assert (r.error or "").startswith(error_start or ""), r.error
    assert r.error is None if success else r.error
    assert r.prompt_tokens == (7 if output_tokens == 3 else 4)
    if success:
        assert r.ttft_s is not None and r.ttft_s <= r.e2el_s


def test_a_timeout_counts_as_a_failure() -> None:
    import httpx2

    from pagellm.bench.serve_load import send_request

    async def handler(request: httpx2.Request) -> httpx2.Response:
        await asyncio.sleep(5)
        raise AssertionError("not reached")

    config = ServeBenchConfig(base_url="http://fake", request_timeout_s=0.05)
    r = RequestRecord(index=0, prompt_len=4, expected_output_len=3, scheduled_s=0.0)

    async def go() -> None:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(handler)) as client:
            await send_request(client, config, r, request_body(config, [1], 3), 0.0)

    asyncio.run(go())
    assert not r.success and r.error == "timed out after 0.05 s"


# ---------------------------------------------------------------- aggregation


def record(
    index: int, ttft: float, token_gaps: list[float], e2el: float | None = None, **kw: object
) -> RequestRecord:
    times = [ttft]
    for gap in token_gaps:
        times.append(times[-1] + gap)
    r = RequestRecord(index=index, prompt_len=10, expected_output_len=len(times), scheduled_s=0.0)
    r.sent_s = 1.0
    r.end_s = 1.0 + (e2el if e2el is not None else times[-1])
    r.success, r.ttft_s, r.chunk_times_s = True, ttft, times
    r.output_tokens, r.prompt_tokens = len(times), 10
    for name, value in kw.items():
        setattr(r, name, value)
    return r


def test_percentiles_interpolate_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert describe_ms([0.001, 0.003]) == {"mean": 2.0, "median": 2.0, "p90": 2.8, "p99": 2.98}
    assert describe_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_summary_throughput_latencies_and_goodput() -> None:
    fast = record(0, 0.1, [0.02, 0.02, 0.02])  # tpot 0.02, e2el 0.16
    slow_first = record(1, 0.8, [0.01])  # ttft over 0.5
    slow_tokens = record(2, 0.2, [0.1, 0.1])  # tpot 0.1
    one_token = record(3, 0.3, [])  # no tpot: meets any tpot SLO
    failed = RequestRecord(index=4, prompt_len=10, expected_output_len=5, scheduled_s=0.0,
                           error="HTTP 503: busy")  # fmt: skip
    records = [fast, slow_first, slow_tokens, one_token, failed]
    assert one_token.tpot_s is None and fast.tpot_s == pytest.approx(0.02)
    assert fast.itls_s == pytest.approx([0.02, 0.02, 0.02])

    slos = parse_goodput_slos(["ttft:0.5", "tpot:0.05"])
    assert slos == {"ttft": 0.5, "tpot": 0.05}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    summary = summarize(records, duration_s=2.0, slos=slos)
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 4 + 2 + 3 + 1
    assert summary["total_input_tokens"] == 40
    assert summary["requests_per_s"] == 2.0
    assert summary["output_tok_s"] == 5.0
    assert summary["total_tok_s"] == 25.0
    assert summary["good_requests"] == 2 and summary["goodput_req_s"] == 1.0
    assert summary["ttft_ms_median"] == pytest.approx(250.0)  # of 100, 200, 300, 800
    assert summary["ttft_ms_mean"] == pytest.approx(350.0)
    # ITL samples: 20, 20, 20, 10, 100, 100 ms.
    assert summary["itl_ms_median"] == pytest.approx(20.0)
    assert summary["itl_ms_mean"] == pytest.approx(45.0)
    assert summary["errors"] == {"HTTP 503: busy": 1}
    assert summary["output_len_mismatches"] == 0

    with_e2el = summarize(records, 2.0, parse_goodput_slos(["e2el:0.2"]))
    assert with_e2el["good_requests"] == 1  # only `fast` ends within 0.2 s
    no_slos = summarize(records, 2.0)
    assert no_slos["goodput_req_s"] is None and no_slos["slos_s"] == {}


@pytest.mark.parametrize("bad", ["ttft", "foo:1", "ttft:x", "tpot:0", "e2el:-1", "e2el:inf"])
def test_bad_goodput_slos_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_goodput_slos([bad])


# ---------------------------------------------------------------- real runs

API_KEY = "bench-key"
RESULT_FIELDS = [
    "bench", "base_url", "endpoint", "model", "request_rate", "burstiness", "max_concurrency",
    "workload", "num_requests", "completed", "failed", "duration_s", "total_input_tokens",
    "total_output_tokens", "requests_per_s", "output_tok_s", "total_tok_s", "slos_s",
    "good_requests", "goodput_req_s", "errors",
] + [f"{m}_ms_{s}" for m in ("ttft", "tpot", "itl", "e2el")
     for s in ("mean", "median", "p90", "p99")]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from hf_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-bench"), "llama", seed=3)
    flags = engine_cli_flags(max_model_len=512, num_gpu_blocks_override=512)
    process = ServerProcess(["--model", str(model), *flags], api_key=API_KEY)
    process.model_name = model.name  # type: ignore[attr-defined]
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    """main(argv + --json) in this process: exit status, the result (stdout is one JSON
    document), stderr."""
    status = main([*argv, "--json"])
    captured = capsys.readouterr()
    return status, json.loads(captured.out), captured.err


def capture_runs(monkeypatch: pytest.MonkeyPatch) -> list[bench_serve.ServeBenchRun]:
    runs: list[bench_serve.ServeBenchRun] = []
    original = bench_serve.run_requests

    async def recording(*args: object, **kwargs: object) -> bench_serve.ServeBenchRun:
        run = await original(*args, **kwargs)
        runs.append(run)
        return run

    monkeypatch.setattr(bench_serve, "run_requests", recording)
    return runs


def test_bench_serve_against_pagellm_serve(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    runs = capture_runs(monkeypatch)
    result_file = tmp_path / "out" / "serve.jsonl"
    argv = [
        "bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY,
        "--num-requests", "12", "--request-rate", "20", "--max-concurrency", "4",
        "--prompt-len", "8", "48", "--output-len", "2", "12", "--token-id-range", "32", "127",
        "--seed", "5", "--goodput", "ttft:600", "tpot:600", "e2el:600",
        "--result-file", str(result_file),
    ]  # fmt: skip
    status, result, _ = run_cli(argv, capsys)
    assert status == 0
    for name in RESULT_FIELDS:
        assert name in result, name
    assert result["completed"] == 12 and result["failed"] == 0 and result["errors"] == {}
    assert result["model"] == server.model_name  # found through /v1/models
    assert result["output_len_mismatches"] == 0
    assert result["output_tokens_from_usage"] == 12
    assert result["good_requests"] == 12  # SLOs no request can miss without timing out
    assert [json.loads(line) for line in result_file.read_text().splitlines()] == [result]

    (run,) = runs
    expected = bench_serve.make_workload(
        bench_serve.WorkloadSpec(num_requests=12, prompt_len=(8, 48), output_len=(2, 12),
                                 seed=5, vocab_low=32, vocab_high=127)
    )  # fmt: skip
    assert result["total_output_tokens"] == sum(r.output_len for r in expected)
    assert result["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    for r, asked in zip(run.records, expected):
        assert r.success, r.error
        assert r.output_tokens == asked.output_len == r.expected_output_len
        assert r.prompt_tokens == len(asked.prompt_token_ids)
        assert r.scheduled_s <= r.sent_s <= r.end_s
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2el_s
        assert len(r.chunk_times_s) <= r.output_tokens
    # Never more than 4 requests in flight.
    for r in run.records:
        in_flight = sum(o.sent_s <= r.sent_s < o.end_s for o in run.records)
        assert in_flight <= 4


def test_bench_serve_chat_endpoint_with_text_prompts(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench", "serve", "--base-url", server.api_url, "--api-key", API_KEY, "--endpoint", "chat",
        "--num-requests", "3", "--prompt-len", "8", "16", "--output-len", "3", "5",
        "--token-id-range", "97", "123", "--result-file", "",
    ]  # fmt: skip
    status, result, _ = run_cli(argv, capsys)
    assert status == 0 and result["completed"] == 3, result["errors"]
    assert result["prompt_format"] == "text" and result["output_len_mismatches"] == 0


def test_wrong_api_key_counts_failures_with_the_servers_message(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--base-url", server.base_url, "--api-key", "wrong",
            "--model", "x", "--num-requests", "2", "--token-id-range", "32", "127",
            "--result-file", ""]  # fmt: skip
    status, result, err = run_cli(argv, capsys)
    assert status == 1 and result["failed"] == 2
    (message,) = result["errors"]
    assert message.startswith("HTTP 401")
    assert "all 2 requests failed" in err and "Traceback" not in err


def test_closed_port_counts_every_request_as_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result_file = tmp_path / "closed.jsonl"
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-requests", "6",
            "--request-rate", "200", "--result-file", str(result_file)]  # fmt: skip
    # Without --json: the table on stdout, the result in --result-file.
    status = main(argv)
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert status == 1  # documented: every request failed
    assert not any(line.startswith("{") for line in out.splitlines())
    assert "failed requests" in out and "error x" in out
    (line,) = result_file.read_text().splitlines()
    result = json.loads(line)
    for name in RESULT_FIELDS:
        assert name in result, name
    assert result["completed"] == 0 and result["failed"] == 6
    assert sum(result["errors"].values()) == 6
    assert all("Connect" in message for message in result["errors"])
    assert "all 6 requests failed" in err and f"127.0.0.1:{port}" in err
    assert "Traceback" not in err


def test_the_engine_and_the_benchmarks_report_the_same_percentiles():
    """LLM.get_metrics() and `pagellm bench serve` summarise latencies with one function."""
    from pagellm.metrics.engine_metrics import latency_summary

    seconds = [0.010, 0.200, 0.030, 0.015, 0.090, 0.011, 0.500]
    engine, bench = latency_summary(seconds), describe_ms(seconds)
    assert (round(engine.p50 * 1000, 3), round(engine.p99 * 1000, 3)) == (bench["median"], bench["p99"])
    assert engine.p99 == pytest.approx(0.200 + 0.3 * 0.94)  # interpolated between the two largest
