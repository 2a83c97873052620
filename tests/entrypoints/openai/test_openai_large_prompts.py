"""A huge prompt is refused (or, on /tokenize, counted) without holding up what else runs:
texts are bounded by characters before they are encoded, a text sure to exceed the context
is refused unencoded, and a long text is encoded on a worker thread that releases the GIL,
never on the event loop nor on the engine thread."""

from __future__ import annotations

import threading
import time

import httpx2
import openai
from serve_helpers import MAX_MODEL_LEN
from test_openai_errors import assert_error

TEN_MB = 10_000_000  # under the default body limit (16 MiB), over the default characters of a text (4 Mi)
OVER_CONTEXT = 3_000_000  # under the character limit, far over the context (one token a byte here)
# The largest pause of the stream running beside them. Before, one 10 MB completions prompt
# was encoded on the engine thread while holding the GIL: the stream stopped for seconds.
MAX_GAP_S = 2.5


def test_huge_prompts_are_refused_without_stalling_a_running_stream(server, model_name):
    arrivals: list[float] = []
    started, done = threading.Event(), threading.Event()

    def run_stream() -> None:
        with openai.OpenAI(base_url=server.api_url, api_key=server.api_key, max_retries=0, timeout=120) as c:
            stream = c.completions.create(
                model=model_name, prompt="steady", max_tokens=MAX_MODEL_LEN - 16, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                arrivals.append(time.perf_counter())
                started.set()
                if done.is_set():
                    break
            stream.close()

    thread = threading.Thread(target=run_stream)
    thread.start()
    assert started.wait(120)
    begin = time.perf_counter()

    def post(path: str, body: dict) -> httpx2.Response:
        return httpx2.post(server.base_url + path, json={"model": model_name, **body}, headers=server.headers(), timeout=120)

    huge, over = "x" * TEN_MB, "y" * OVER_CONTEXT
    chat = {"max_tokens": 2}
    refused = [
        ("/v1/completions", {"prompt": huge, "max_tokens": 2}, "prompt", "characters"),
        ("/v1/completions", {"prompt": over, "max_tokens": 2}, "prompt", "max_model_len"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": huge}]}, "messages", "characters"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": over}]}, "prompt", "max_model_len"),
        ("/v1/embeddings", {"input": huge}, "input", "characters"),
        ("/v1/embeddings", {"input": over}, "input", "max_model_len"),
        ("/v1/responses", {"input": huge, "max_output_tokens": 2}, "input", "characters"),
        ("/v1/responses", {"input": over, "max_output_tokens": 2}, "prompt", "max_model_len"),
        ("/tokenize", {"prompt": huge}, "prompt", "characters"),
    ]
    for path, body, param, fragment in refused:
        assert_error(post(path, body), 400, param, fragment)
    for content in (huge, over):
        message = post("/v1/messages", {**chat, "messages": [{"role": "user", "content": content}]})
        assert message.status_code == 400 and message.json()["error"]["type"] == "invalid_request_error", message.text
    # Counting is what /tokenize is for: a text over the context is encoded (off the loop) and counted.
    counted = post("/tokenize", {"prompt": "z" * 1_000_000})
    assert counted.status_code == 200 and counted.json()["count"] == 1_000_000
    end = time.perf_counter()
    done.set()
    thread.join(120)
    during = [t for t in arrivals if begin <= t <= end]
    assert len(during) > 10, "the stream must have run while the prompts were refused"
    window = [begin, *during, end]
    largest = max(b - a for a, b in zip(window, window[1:]))
    print(f"largest gap {largest:.3f} s over {end - begin:.1f} s")
    assert largest < MAX_GAP_S, f"the stream paused {largest:.2f} s"
