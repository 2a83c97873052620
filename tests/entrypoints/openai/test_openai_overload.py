"""Admission control and graceful shutdown, on a server of its own.

One running slot (--max-num-seqs 1) held by a long request, and room for 3 waiting
(--max-num-queued-requests 3): a burst of 10 gets exactly 3 accepted and 7 refused with
503, whatever the timing, because nothing leaves the queue until the test lets the long
request go. The last test stops the server with SIGTERM mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Iterator

import httpx2
import pytest
from serve_helpers import (
    API_KEY,
    MAX_MODEL_LEN,
    ServerProcess,
    engine_cli_flags,
    greedy_offline,
)

MAX_QUEUED = 3
BURST = 10
LONG = MAX_MODEL_LEN - 64


@pytest.fixture(scope="module")
def small_server(tiny_model: str) -> Iterator[ServerProcess]:
    args = [
        "--model", tiny_model,
        *engine_cli_flags(max_num_seqs=1),
        "--max-num-queued-requests", str(MAX_QUEUED),
        "--shutdown-timeout", "1",
    ]
    # The key comes from $PAGELLM_API_KEY here (--api-key on the main server).
    process = ServerProcess(args, api_key=API_KEY, api_key_in_env=True)
    yield process
    if process.process.poll() is None:
        assert process.stop(signal.SIGINT) == 0, process.log


class LongStream:
    """A streaming request that runs until closed, read by a thread."""

    def __init__(self, server: ServerProcess, model: str) -> None:
        self.first_chunk = threading.Event()
        self.events: list[str] = []
        self.closing = threading.Event()
        body = {
            "model": model, "prompt": "blocker", "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True,
        }
        self._thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self._thread.start()
        assert self.first_chunk.wait(120), "the long stream did not start"

    def _read(self, server: ServerProcess, body: dict) -> None:
        with httpx2.stream(
            "POST", server.api_url + "/completions", json=body, headers=server.headers(), timeout=120
        ) as response:
            for line in response.iter_lines():
                if line:
                    self.events.append(line)
                    self.first_chunk.set()
                if self.closing.is_set():
                    return  # leaves the block: the connection closes mid-stream

    @property
    def finished(self) -> bool:
        return any('"finish_reason":"' in e for e in self.events)

    def close(self) -> None:
        self.closing.set()
        self._thread.join(120)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


async def burst(
    client: httpx2.AsyncClient, server: ServerProcess, model: str
) -> tuple[list[httpx2.Response], dict[int, asyncio.Task]]:
    """Send BURST requests at once; return the refusals, and the tasks still waiting by
    the index of their prompt."""
    tasks = {
        i: asyncio.create_task(
            client.post(
                server.api_url + "/completions",
                json={"model": model, "prompt": f"burst {i}", "max_tokens": 8, "temperature": 0},
            )
        )
        for i in range(BURST)
    }
    refused: list[httpx2.Response] = []
    pending = set(tasks.values())
    while len(refused) < BURST - MAX_QUEUED:
        done, pending = await asyncio.wait(pending, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        assert done, "the refusals did not come"
        refused += [t.result() for t in done]
    return refused, {i: t for i, t in tasks.items() if t in pending}


def test_api_key_from_the_environment(small_server):
    assert httpx2.get(small_server.api_url + "/models", timeout=30).status_code == 401
    ok = httpx2.get(small_server.api_url + "/models", headers=small_server.headers(), timeout=30)
    assert ok.status_code == 200


def test_a_burst_past_the_queue_limit_gets_503s(small_server, model_name, offline_llm):
    async def scenario() -> tuple[list[httpx2.Response], dict[int, httpx2.Response]]:
        blocker = LongStream(small_server, model_name)
        async with httpx2.AsyncClient(timeout=120, headers=small_server.headers()) as client:
            refused, waiting = await burst(client, small_server, model_name)
            assert len(waiting) == MAX_QUEUED
            assert not blocker.finished, "the long request ended before the burst was judged"
            blocker.close()  # its slot frees up: the queued ones run
            answers = {i: await task for i, task in waiting.items()}
        return refused, answers

    refused, answers = asyncio.run(scenario())
    for response in refused:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "overloaded"
        assert "max-num-queued-requests" in error["message"]
        # The clients' retries wait this long (1-60 s; 1 before any request finished).
        assert 1 <= int(response.headers["Retry-After"]) <= 60
    for i, response in answers.items():
        assert response.status_code == 200, response.text
        expected = greedy_offline(offline_llm, f"burst {i}", 8).outputs[0].text
        assert response.json()["choices"][0]["text"] == expected


def test_sigterm_finishes_in_flight_streams_and_exits_0(small_server, model_name):
    stream = LongStream(small_server, model_name)
    status = small_server.stop(signal.SIGTERM)
    stream.join(60)
    assert status == 0, small_server.log
    # The request could not finish in the grace period: it was aborted, and its stream
    # still ended properly.
    assert stream.events[-1] == "data: [DONE]"
    last = json.loads(stream.events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert "shutting down" in small_server.log
