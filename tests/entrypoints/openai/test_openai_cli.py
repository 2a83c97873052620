"""`pagellm serve` on the command line: its flags, a busy port, the embedded model."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx2
import pytest
from serve_helpers import ServerProcess

from pagellm.config.engine_args import EngineArgs
from pagellm.entrypoints.cli import build_parser
from pagellm.config.cli_args import engine_args_from_namespace


def test_serve_takes_server_flags_and_every_engine_argument():
    args = build_parser().parse_args(
        ["serve", "--model", "m.gguf", "--max-num-seqs", "3", "--no-enable-prefix-caching",
         "--served-model-name", "mine", "--max-num-queued-requests", "7"]
    )
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.served_model_name == "mine" and args.max_num_queued_requests == 7
    engine_args = engine_args_from_namespace(args)
    assert engine_args == EngineArgs(model="m.gguf", max_num_seqs=3, enable_prefix_caching=False)


def test_a_busy_port_is_one_clear_error_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pagellm: error:")]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0]


@pytest.mark.slow
def test_without_model_it_serves_the_embedded_smollm2(smollm2_path):
    server = ServerProcess(["--max-model-len", "512"])
    try:
        models = httpx2.get(server.api_url + "/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        answer = httpx2.post(
            server.api_url + "/chat/completions",
            json={"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8,
                  "temperature": 0},
            timeout=120,
        ).json()
        assert answer["choices"][0]["message"]["content"].strip()
        assert answer["usage"]["completion_tokens"] >= 1
        assert "KV cache:" in server.log and "SmolLM2-135M-Instruct" in server.log
    finally:
        assert server.stop(signal.SIGINT) == 0, server.log
