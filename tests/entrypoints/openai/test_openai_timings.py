"""Per-request timings (`"timings": true`, or --enable-per-request-metrics): llama.cpp's
names, on completions, chat, Messages and Responses, whole and streamed."""

from __future__ import annotations

import json

import httpx2

PROMPT = "timings: " + "a long enough prompt to fill a block " * 3


def post(server, path: str, body: dict) -> dict:
    response = httpx2.post(server.base_url + path, json=body, headers=server.headers(), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def check(timings: dict, prompt_tokens: int, output_tokens: int) -> None:
    assert timings["prompt_n"] + timings["cache_n"] == prompt_tokens
    assert timings["predicted_n"] == output_tokens
    assert 0 <= timings["queue_ms"] <= timings["ttft_ms"] <= timings["total_ms"]
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0
    # Each figure is rounded to a microsecond on its own: the sum may be off by 1.5 of them.
    assert timings["ttft_ms"] >= timings["queue_ms"] + timings["prompt_ms"] - 2e-3
    assert abs(timings["predicted_per_token_ms"] * (output_tokens - 1) - timings["predicted_ms"]) < 1e-2
    assert timings["preemptions"] == 0 and timings["draft_n"] == timings["draft_n_accepted"] == 0
    assert timings["cache_n_tier"] == 0  # no disk tier here


def test_completions_carry_timings_when_asked(server, model_name):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    assert "timings" not in post(server, "/v1/completions", body)
    first = post(server, "/v1/completions", {**body, "timings": True})
    check(first["timings"], first["usage"]["prompt_tokens"], 5)
    again = post(server, "/v1/completions", {**body, "timings": True})  # the prompt's blocks are cached now
    assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    several = post(server, "/v1/completions", {**body, "prompt": [PROMPT, "other"], "timings": True})
    assert isinstance(several["timings"], list) and len(several["timings"]) == 2


def test_chat_messages_and_responses_carry_timings_whole_and_streamed(server, model_name):
    chat = {"model": model_name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "ignore_eos": True, "timings": True}
    whole = post(server, "/v1/chat/completions", chat)
    check(whole["timings"], whole["usage"]["prompt_tokens"], 4)
    streamed = httpx2.post(server.base_url + "/v1/chat/completions", json={**chat, "stream": True}, headers=server.headers(), timeout=60)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "timings" in chunks[-1] and all("timings" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["timings"]["predicted_n"] == 4
    message = post(server, "/v1/messages", {"model": model_name, "max_tokens": 4, "messages": chat["messages"], "timings": True})
    assert message["timings"]["predicted_n"] == message["usage"]["output_tokens"]
    events = httpx2.post(server.base_url + "/v1/messages", json={"model": model_name, "max_tokens": 4, "messages": chat["messages"],
                         "timings": True, "stream": True}, headers=server.headers(), timeout=60).text  # fmt: skip
    delta = next(json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: ") and '"message_delta"' in line)
    assert delta["timings"]["predicted_n"] == delta["usage"]["output_tokens"]
    response = post(server, "/v1/responses", {"model": model_name, "input": PROMPT, "max_output_tokens": 3, "timings": True})
    assert response["timings"]["predicted_n"] == response["usage"]["output_tokens"]
