"""Sleep and wake-up on the server: POST /sleep, POST /wake_up, GET /is_sleeping, the idle
timer (--sleep-idle-seconds), and a request that comes while the engine sleeps: it wakes
the engine, waits, and gets the answer it would have got awake."""

from __future__ import annotations

import httpx2
import pytest
from serve_helpers import ServerProcess, greedy_offline, wait_until


@pytest.fixture(scope="module")
def sleepy(tiny_model):
    server = ServerProcess(["--model", tiny_model, "--max-model-len", "256", "--sleep-idle-seconds", "1"])
    yield server
    assert server.stop() == 0, server.log


def is_sleeping(server) -> dict:
    return httpx2.get(server.base_url + "/is_sleeping", timeout=30).json()


def completion(server) -> str:
    body = {"prompt": "wake up", "max_tokens": 6, "temperature": 0}
    response = httpx2.post(server.api_url + "/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def sleep_level_metric(server) -> float:
    metrics = httpx2.get(server.base_url + "/metrics", timeout=30).text
    return float(next(line for line in metrics.splitlines() if line.startswith("pagellm:sleep_level{")).rsplit(" ", 1)[1])


def test_the_idle_timer_sleeps_and_a_request_wakes(sleepy, offline_llm):
    expected = greedy_offline(offline_llm, "wake up", 6).outputs[0].text
    assert completion(sleepy) == expected
    wait_until(lambda: is_sleeping(sleepy)["is_sleeping"], timeout_s=60)  # a second without requests
    assert is_sleeping(sleepy)["level"] == 1 and sleep_level_metric(sleepy) == 1
    assert completion(sleepy) == expected  # it waited for the engine to wake, never refused
    assert "no request for 1 s: sleeping" in sleepy.log and "awake (from level 1)" in sleepy.log


def test_sleep_and_wake_up_on_request(sleepy, offline_llm):
    expected = greedy_offline(offline_llm, "wake up", 6).outputs[0].text
    asleep = httpx2.post(sleepy.base_url + "/sleep", params={"level": 2}, timeout=60)
    assert asleep.status_code == 200 and asleep.json() == {"is_sleeping": True, "level": 2}
    assert is_sleeping(sleepy) == {"is_sleeping": True, "level": 2}
    assert httpx2.post(sleepy.base_url + "/wake_up", timeout=60).json() == {"is_sleeping": False}
    assert completion(sleepy) == expected
    bad = httpx2.post(sleepy.base_url + "/sleep", params={"level": 3}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    assert httpx2.post(sleepy.base_url + "/sleep", params={"level": 2}, timeout=60).status_code == 200
    assert completion(sleepy) == expected  # the weights come back for it
