"""The live dashboard: /v1/engine/state and the page in headless Chromium under load."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.request

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


class Load:
    """Streaming requests with many tokens, started and cancelled by the test."""

    def __init__(self, server, count: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=server.api_url, api_key=server.api_key, max_retries=0, timeout=120)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def _one(self, i: int) -> None:
        shared = "a shared prefix that fills more than one block of the cache " * 2
        with self.client.completions.create(
            model=self.client.models.list().data[0].id,
            prompt=shared + f"request {i}",
            max_tokens=8000,
            stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:
            for _ in stream:
                if self.stop.is_set():
                    break

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
        self.client.close()


def wait_until(predicate, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def test_engine_state_describes_blocks_and_queues(server):
    # One request first, so its prompt blocks are cached before the other two arrive and
    # share them (requests admitted in the same step would compute the prefix each).
    first = Load(server, 1)
    wait_until(lambda: any(r["output_tokens"] > 0 for r in get_json(server.base_url + "/v1/engine/state")["requests"]))
    load = Load(server, 2)
    try:
        state = wait_until(lambda: (s := get_json(server.base_url + "/v1/engine/state"))["queues"]["running"] == 3 and s)
        # After a one-second metrics window of work, the engine says what bounds it.
        busy = wait_until(lambda: (s := get_json(server.base_url + "/v1/engine/state"))["utilization"] and s)
    finally:
        load.close()
        first.close()
    used = busy["utilization"]
    assert used["summary"].startswith("bound: ") and used["mfu"] > 0 and used["mbu"] > 0
    assert used["flops_ceiling"] > 0 and used["bandwidth_ceiling"] > 0
    assert "mfu" in busy["series"][-1] and "mbu" in busy["series"][-1]
    blocks = state["blocks"]
    assert len(blocks["state"]) == len(blocks["owner"]) == 4096
    assert blocks["state"][0] == 2  # the null block
    running = [r for r in state["requests"] if r["status"] == "running"]
    assert len(running) == 3
    owned = {state["requests"][o]["id"] for o, s in zip(blocks["owner"], blocks["state"]) if s in (3, 4)}
    assert owned == {r["id"] for r in running}
    # The three prompts share full prefix blocks: some blocks have several holders.
    assert 4 in blocks["state"]
    assert sum(r["device_blocks"] for r in running) >= blocks["state"].count(3) + blocks["state"].count(4)
    # When the load is gone, the engine drains and the map shows no owned block.
    idle = wait_until(lambda: (s := get_json(server.base_url + "/v1/engine/state"))["queues"]["running"] == 0 and s)
    assert not {3, 4} & set(idle["blocks"]["state"]) and idle["requests"] == []


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/test.sh installs it where apt-get works)")
def test_dashboard_renders_in_headless_chromium_under_load(server, tmp_path):
    page = server.base_url + "/dashboard/"
    with urllib.request.urlopen(page, timeout=30) as response:
        assert b"block-map" in response.read()
    load = Load(server, 4)
    try:
        wait_until(lambda: get_json(server.base_url + "/v1/engine/state")["queues"]["running"] == 4)
        flags = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1000",
            "--virtual-time-budget=4000",
        ]  # fmt: skip
        dom = subprocess.run(
            [*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120
        ).stdout
        shot = tmp_path / "dashboard.png"
        subprocess.run([*flags, f"--screenshot={shot}", page], capture_output=True, timeout=120)
    finally:
        load.close()
    # The page polled more than once (it updates), and drew the block map of the live engine.
    updates = int(dom.split('data-updates="', 1)[1].split('"', 1)[0])
    assert updates >= 2
    assert 'data-blocks="4096"' in dom
    used = int(dom.split('data-used="', 1)[1].split('"', 1)[0])
    assert used > 0
    assert dom.count("<tr>") >= 1 + 4  # header + the running requests
    assert "running" in dom and "status live" in dom
    assert "bound: " in dom.split('id="bound"', 1)[1][:200]
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[0] >= 900 and pixels.std() > 0.05  # not a blank page
