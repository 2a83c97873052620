"""Limits on client-controlled input: each a flag, each refusal a 4xx naming the field,
the body's size a 413 whether or not the client says how long it is; the API key never
reaches the log."""

from __future__ import annotations

import pytest
from serve_helpers import ServerProcess
from test_openai_errors import assert_error

import httpx2

KEY = "limits-secret-key-42"


@pytest.fixture(scope="module")
def limited(tiny_model):
    flags = {
        "max-request-body-bytes": 2000, "max-prompts-per-request": 2, "max-n": 2, "max-stop-strings": 2,
        "max-stop-string-length": 5, "max-logit-bias-entries": 2, "max-messages": 2, "max-message-chars": 50,
    }  # fmt: skip
    args = ["--model", tiny_model, "--max-model-len", "256"]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    server = ServerProcess(args, api_key=KEY)
    yield server
    assert server.stop() == 0, server.log
    assert KEY not in server.log


def post(server, path: str, body: dict) -> httpx2.Response:  # noqa: ANN001
    return httpx2.post(server.api_url + path, json=body, headers=server.headers(), timeout=60)


def test_each_limit_is_a_400_naming_its_field(limited):
    completion = {"prompt": "hi", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = [
        ("/completions", {**completion, "prompt": ["a", "b", "c"]}, "prompt"),
        ("/completions", {**completion, "n": 3}, "n"),
        ("/completions", {**completion, "stop": ["a", "b", "c"]}, "stop"),
        ("/completions", {**completion, "stop": "toolong"}, "stop"),
        ("/completions", {**completion, "stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
        ("/completions", {**completion, "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
        ("/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}] * 3}, "messages"),
        ("/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * 51}]}, "messages"),
        ("/chat/completions", {**chat, "n": 3}, "n"),
        # A text prompt or input has a message's character limit.
        ("/completions", {**completion, "prompt": "x" * 51}, "prompt"),
        ("/completions", {**completion, "prompt": ["x", "x" * 51]}, "prompt"),
        ("/embeddings", {"input": "x" * 51}, "input"),
        ("/embeddings", {"input": ["x" * 51]}, "input"),
    ]
    for path, body, field in refused:
        assert_error(post(limited, path, body), 400, field)
    # At the limits, served.
    assert post(limited, "/completions", {**completion, "prompt": ["a", "b"], "n": 2, "stop": ["ab", "cd"]}).status_code == 200
    assert post(limited, "/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * 50}]}).status_code == 200
    assert post(limited, "/completions", {**completion, "prompt": "x" * 50}).status_code == 200
    tokenize = limited.base_url + "/tokenize"
    assert_error(httpx2.post(tokenize, json={"prompt": "x" * 51}, headers=limited.headers(), timeout=60), 400, "prompt")


def test_a_body_over_the_limit_is_413(limited):
    big = {"prompt": "x" * 3000, "max_tokens": 2}
    assert_error(post(limited, "/completions", big), 413, None, "2000 bytes")

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'", "max_tokens": 2}'

    response = httpx2.post(
        limited.api_url + "/completions", content=chunks(),
        headers={**limited.headers(), "Content-Type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert_error(response, 413, None, "2000 bytes")
    assert post(limited, "/completions", {"prompt": "fine", "max_tokens": 2}).status_code == 200


def test_bad_limit_flags_are_refused():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--max-n", "0"], capture_output=True, text=True
    )
    assert result.returncode != 0 and "--max-n must be at least 1" in result.stderr + result.stdout
