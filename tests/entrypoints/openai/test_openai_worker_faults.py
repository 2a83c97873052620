"""A tensor-parallel worker killed under a running server: the in-flight request gets a 503
naming the dead rank, /health says 503, and the process exits with status 1 within seconds
(so an orchestrator restarts it)."""

import os
import re
import signal
import threading
import time

import httpx2 as httpx
from hf_models import make_tiny_hf_checkpoint
from serve_helpers import ServerProcess, engine_cli_flags


def test_server_answers_503_and_exits_nonzero(tmp_path):
    tiny = str(make_tiny_hf_checkpoint(tmp_path, max_position_embeddings=2048))
    server = ServerProcess(["--model", tiny, "--served-model-name", "x", "--tensor-parallel-size", "2", *engine_cli_flags(max_model_len=2048)])
    try:
        match = re.search(r"rank 1 pid (\d+)", server.log)
        assert match, server.log
        pid = int(match.group(1))
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            assert client.get("/health").status_code == 200
            errors: list[httpx.Response] = []

            def long_request() -> None:
                errors.append(client.post("/v1/completions", json={"model": "x", "prompt": "hello", "max_tokens": 1500, "ignore_eos": True}))

            request = threading.Thread(target=long_request)
            request.start()
            time.sleep(1.0)  # the request is running
            os.kill(pid, signal.SIGKILL)
            request.join(timeout=30)
            assert errors and errors[0].status_code == 503, errors and errors[0].text
            body = errors[0].json()["error"]
            assert "rank 1" in body["message"] and body["code"] == "engine_dead"
            health = client.get("/health")
            assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        assert server.process.wait(timeout=30) == 1
    finally:
        if server.process.poll() is None:
            server.process.kill()
