"""The server against its own /openapi.json: schemathesis (`st run --checks all`)
generates valid and invalid requests for every operation from the published schema and
runs every check it has: no 5xx, statuses, content types, headers and bodies as
documented, invalid data refused, valid data accepted, the API key enforced, 405 with
Allow, ...

A schema cannot say everything: a few rules relate two fields (min_tokens and
max_tokens), depend on what the text becomes (the prompt's tokens within max_model_len)
or on whether a grammar compiles. A schema-valid request that breaks one of those gets
a 400, and only a 400 naming such a rule passes the "valid data is accepted" check
(openapi_fuzz_hooks.py); every other check still runs on it.

The server is small on purpose (short context, few completions, small limits) so that
generated requests finish fast and the limits are reached.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from serve_helpers import API_KEY, ServerProcess, engine_drained, get_metrics, wait_until

EXAMPLES_PER_OPERATION = 10
SEED = 20261201
OPERATIONS = [
    "GET /health", "GET /metrics", "GET /v1/models", "GET /v1/engine/state",
    "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
    "POST /v1/embeddings", "POST /v1/responses", "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}", "POST /v1/responses/{response_id}/cancel",
    "POST /v1/messages", "POST /v1/messages/count_tokens",
    "POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}", "DELETE /v1/files/{file_id}",
    "GET /v1/files/{file_id}/content", "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}",
    "POST /v1/batches/{batch_id}/cancel", "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter",
]  # fmt: skip
FUZZ_SERVER_FLAGS = [
    "--max-model-len", "96",
    "--num-gpu-blocks-override", "256",
    "--max-n", "3",
    "--max-num-seqs", "2",  # below --max-n: the schema publishes the smaller bound
    "--max-prompts-per-request", "3",
    "--max-stop-strings", "3",
    "--max-stop-string-length", "16",
    "--max-logit-bias-entries", "4",
    "--max-messages", "4",
    "--max-message-chars", "64",
    "--max-request-body-bytes", "16384",
    "--max-logprobs", "5",
    "--enable-lora",  # the adapter routes check what they are given, not only that LoRA is off
]  # fmt: skip


def schemathesis_cli() -> str:
    pytest.importorskip("schemathesis")
    cli = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if cli is None:
        pytest.skip("the schemathesis command `st` is not installed")
    return cli


def test_server_keeps_its_published_contract(tiny_model: str, tmp_path: Path) -> None:
    cli = schemathesis_cli()
    server = ServerProcess(["--model", tiny_model, *FUZZ_SERVER_FLAGS], api_key=API_KEY)
    log = tmp_path / "responses.jsonl"
    # An invalid body over --max-request-body-bytes is refused by its size (413) before it is
    # read: as much a rejection as a 400.
    (tmp_path / "schemathesis.toml").write_text(
        '[checks.negative_data_rejection]\nexpected-statuses = ["400", "401", "403", "404", "405", "413"]\n'
    )
    try:
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "openapi_fuzz_hooks",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
            "PAGELLM_FUZZ_LOG": str(log),
        }
        command = [
            cli, "run", server.base_url + "/openapi.json",
            "--checks", "all",
            "--exclude-checks", "positive_data_acceptance",  # replaced by the hooks' version
            "--header", f"Authorization: Bearer {API_KEY}",
            "--max-examples", str(EXAMPLES_PER_OPERATION),
            "--seed", str(SEED),
            "--workers", "1",
            "--request-timeout", "60",
            "--report-dir", str(tmp_path / "reports"),
            "--no-color",
        ]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
        assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
        # Nothing left behind: no request in the engine, every KV block back in the pool.
        drained = wait_until(lambda: engine_drained(server.base_url), timeout_s=30)
        assert drained, get_metrics(server.base_url)
        health = httpx2.get(server.base_url + "/health", timeout=10)
        assert health.status_code == 200, health.text
    finally:
        status = server.stop(signal.SIGINT)
    assert status == 0, server.log
    assert "Traceback" not in server.log, server.log

    responses = [json.loads(line) for line in log.read_text().splitlines()]
    per_operation = collections.Counter(f"{method} {path}" for method, path, _, _ in responses)
    statuses = collections.Counter(status for _, _, status, _ in responses)
    documented = sum(1 for *_, by_rule in responses if by_rule)
    print(
        f"\nschemathesis: {len(responses)} requests, statuses {dict(sorted(statuses.items()))}, "
        f"{documented} refused by a documented rule; per operation:"
    )
    for operation in OPERATIONS:
        print(f"  {operation}: {per_operation[operation]}")
    # Every operation was exercised, those with a body many times; no 5xx at all.
    assert all(per_operation[operation] >= 1 for operation in OPERATIONS), per_operation
    assert all(per_operation[op] >= EXAMPLES_PER_OPERATION for op in OPERATIONS if op.startswith("POST")), per_operation
    assert not [status for status in statuses if status >= 500], statuses
