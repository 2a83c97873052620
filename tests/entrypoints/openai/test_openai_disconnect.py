"""A client that goes away gets its request aborted and its KV blocks freed.

The requests ask for far more tokens than they could produce while the test waits, so
"finished with reason abort" can only come from the disconnect; /metrics shows the
engine drained afterwards.
"""

from __future__ import annotations

import asyncio
import json

import httpx2
from serve_helpers import (
    MAX_MODEL_LEN,
    engine_drained,
    get_metrics,
    greedy_offline,
    parse_metrics,
    wait_until,
)

NUM_STREAMS = 50
LONG = MAX_MODEL_LEN - 64  # tokens: far longer than any wait below
ABORTED = 'pagellm:request_success_total{finished_reason="abort"}'


def long_body(model: str, prompt: str, stream: bool) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def open_streams_then_leave(server, model: str) -> int:  # noqa: ANN001
    """Open NUM_STREAMS streams, read each one's first token, then close them all."""
    url = server.api_url + "/completions"
    started = asyncio.Event()
    num_started = 0

    async with httpx2.AsyncClient(timeout=120, headers=server.headers()) as client:

        async def one(i: int) -> bool:
            nonlocal num_started
            body = long_body(model, f"Stream number {i}", stream=True)
            async with client.stream("POST", url, json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: ") :])
                        assert chunk["choices"][0]["finish_reason"] is None
                        break
                num_started += 1
                if num_started == NUM_STREAMS:
                    started.set()
                # All streams are open at once before any client leaves.
                await started.wait()
            return True  # leaving the block closes the connection mid-stream

        results = await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))
    return sum(results)


def test_abandoned_streams_are_aborted_and_free_their_blocks(server, model_name, offline_llm):
    aborted_before = get_metrics(server.base_url).get(ABORTED, 0)

    assert asyncio.run(open_streams_then_leave(server, model_name)) == NUM_STREAMS

    metrics = wait_until(lambda: engine_drained(server.base_url), timeout_s=60)
    assert metrics[ABORTED] - aborted_before == NUM_STREAMS
    # The server goes on serving.
    expected = greedy_offline(offline_llm, "after", 8).outputs[0].text
    response = httpx2.post(
        server.api_url + "/completions",
        json={"model": model_name, "prompt": "after", "max_tokens": 8, "temperature": 0},
        headers=server.headers(),
        timeout=60,
    )
    assert response.json()["choices"][0]["text"] == expected


async def start_then_leave(server, model: str) -> None:  # noqa: ANN001
    """A non-streaming request, given up by its client once the engine runs it."""
    async with httpx2.AsyncClient(timeout=120, headers=server.headers()) as client:
        request = asyncio.create_task(
            client.post(server.api_url + "/completions", json=long_body(model, "wait", stream=False))
        )
        while not request.done():
            metrics = parse_metrics((await client.get(server.base_url + "/metrics")).text)
            if metrics["pagellm:num_requests_running"] >= 1:
                break
            await asyncio.sleep(0.02)
        assert not request.done(), "the long request finished before it could be abandoned"
        request.cancel()
        try:
            await request
        except asyncio.CancelledError:
            pass


def test_abandoned_non_streaming_request_is_aborted(server, model_name):
    aborted_before = get_metrics(server.base_url).get(ABORTED, 0)
    log_before = len(server.log_lines)
    asyncio.run(start_then_leave(server, model_name))
    metrics = wait_until(lambda: engine_drained(server.base_url), timeout_s=60)
    assert metrics[ABORTED] - aborted_before == 1
    # A client's timeout is not the server's error: one line, no traceback.
    def log_once_logged() -> str:
        text = "".join(server.log_lines[log_before:])
        return text if "the client disconnected before the answer" in text else ""

    log = wait_until(log_once_logged)
    assert "Traceback" not in log and "ERROR" not in log and "Exception in ASGI application" not in log, log
