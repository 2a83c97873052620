"""A failing engine step seen from HTTP: its request gets a 500 in OpenAI's shape (or a
final SSE error event when streaming), never a hang; the server goes on serving; steps
failing over and over take the engine down, /health turns 503 and the process exits 1."""

from __future__ import annotations

import json

import httpx2
from serve_helpers import ServerProcess, wait_until

from pagellm.worker.fault_injection import ENV_VAR


def completion(server, stream: bool = False, max_tokens: int = 4) -> httpx2.Response:  # noqa: ANN001
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    return httpx2.post(server.api_url + "/completions", json=body, timeout=60)


def test_failed_steps_fail_their_requests_and_the_server_serves_on(tiny_model, monkeypatch):
    # Requests run one at a time: request 1 is steps 1-2 (fails at 2), request 2 steps
    # 3-6, the streamed request 3 steps 7-... (fails at 8).
    monkeypatch.setenv(ENV_VAR, "steps=2:8")
    server = ServerProcess(["--model", tiny_model, "--max-model-len", "256"])
    try:
        failed = completion(server)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["code"] == "internal_error" and "InjectedFault" in error["message"]
        served = completion(server)
        assert served.status_code == 200 and len(served.json()["choices"][0]["text"]) > 0
        streamed = completion(server, stream=True)
        assert streamed.status_code == 200
        events = [line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data: ")]
        last = json.loads(events[-2] if events[-1] == "[DONE]" else events[-1])
        assert last["error"]["code"] == "internal_error", events
        assert httpx2.get(server.base_url + "/health", timeout=30).status_code == 200
        assert completion(server).status_code == 200
        metrics = httpx2.get(server.base_url + "/metrics", timeout=30).text
        assert 'finished_reason="error"' in metrics
        failures = [line for line in metrics.splitlines() if line.startswith("pagellm:request_failures_total")]
        assert failures and float(failures[0].rsplit(" ", 1)[1]) == 2  # the two failed requests
    finally:
        assert server.stop() == 0, server.log


def test_steps_failing_over_and_over_stop_the_server(tiny_model, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "rate=1.0")
    server = ServerProcess(["--model", tiny_model, "--max-model-len", "256"])
    try:
        for _ in range(3):
            assert completion(server).status_code in (500, 503)
        wait_until(lambda: server.process.poll() is not None, timeout_s=60)
        assert server.process.returncode == 1, server.log
        assert "engine step(s) failed in a row" in server.log
    finally:
        server.stop()


def test_a_step_that_hangs_fails_health_until_it_returns(tiny_model, monkeypatch):
    """A step blocked for 3 s (a stuck kernel) against --health-stall-seconds 1: /health
    turns 503 engine_stalled while it hangs, 200 again once steps complete, and the request
    it held up is answered."""
    import threading

    monkeypatch.setenv(ENV_VAR, "hang=2:3")
    server = ServerProcess(["--model", tiny_model, "--max-model-len", "256", "--health-stall-seconds", "1"])
    try:
        assert httpx2.get(server.base_url + "/health", timeout=30).status_code == 200  # idle: no stall
        answers: list[httpx2.Response] = []
        request = threading.Thread(target=lambda: answers.append(completion(server, max_tokens=6)))
        request.start()

        def health() -> httpx2.Response:
            return httpx2.get(server.base_url + "/health", timeout=30)

        stalled = wait_until(lambda: (r := health()).status_code == 503 and r, timeout_s=30)
        error = stalled.json()["error"]
        assert error["code"] == "engine_stalled" and "--health-stall-seconds 1" in error["message"]
        wait_until(lambda: health().status_code == 200, timeout_s=30)
        request.join(60)
        assert answers and answers[0].status_code == 200, answers
    finally:
        assert server.stop() == 0, server.log
