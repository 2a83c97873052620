"""Helpers of the server tests: a real `pagellm serve` process, the shared settings, polling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

READY_MARK = "pagellm is ready: model "
API_KEY = "test-key-123"
# A long context, so that a request can be made to run far longer than any test waits
# (the disconnect and overload tests cancel such requests).
MAX_MODEL_LEN = 16384
ENGINE_FLAGS: dict[str, object] = {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks_override": 4096}


def engine_cli_flags(**overrides: object) -> list[str]:
    """ENGINE_FLAGS (updated by overrides) as command-line flags."""
    args: list[str] = []
    for name, value in {**ENGINE_FLAGS, **overrides}.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args


def greedy_offline(llm, prompt: str | list[int], max_tokens: int, **params: object):  # noqa: ANN001, ANN201
    """The offline API's greedy answer to one prompt (a RequestOutput)."""
    from pagellm import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return llm.generate([prompt], sampling, use_tqdm=False)[0]


START_TIMEOUT_S = 180.0


class ServerProcess:
    """`python -m pagellm.entrypoints.cli serve ARGS --port 0`; the URL is read from its log."""

    def __init__(
        self, args: Sequence[str], api_key: str | None = None, api_key_in_env: bool = False
    ) -> None:
        self.api_key = api_key
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", "0", *args]
        if "--batch-dir" not in args:  # never the user's own batches, nor another test's
            command += ["--batch-dir", tempfile.mkdtemp(prefix="pagellm-batches-")]
        env = dict(os.environ)
        env.pop("PAGELLM_API_KEY", None)
        if api_key is not None and api_key_in_env:
            env["PAGELLM_API_KEY"] = api_key
        elif api_key is not None:
            command += ["--api-key", api_key]
        # One torch thread: on a small shared machine, several processes each spinning
        # their own OpenMP threads slow every step down by orders of magnitude.
        env["OMP_NUM_THREADS"] = "1"
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.log_lines: list[str] = []
        self._ready = threading.Event()
        self.base_url = ""
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or not self.base_url:
            self.process.kill()
            raise RuntimeError("the server did not start:\n" + self.log)

    def _read_log(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log_lines.append(line)
            if READY_MARK in line and not self.base_url:
                # "... at http://127.0.0.1:PORT/v1 (KV cache ..."
                self.base_url = line.split(" at ", 1)[1].split("/v1", 1)[0]
                self._ready.set()
        self._ready.set()  # the process ended: stop waiting

    @property
    def log(self) -> str:
        return "".join(self.log_lines)

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Signal the server and wait for it to exit; returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self._reader.join(5)


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.05):  # noqa: ANN001, ANN201
    """Poll until predicate() is truthy; return its value, or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def get_metrics(base_url: str) -> dict[str, float]:
    import httpx2

    response = httpx2.get(base_url + "/metrics", timeout=30)
    response.raise_for_status()
    return parse_metrics(response.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, with the model_name label left out."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        if "{" in key:
            name, labels = key[:-1].split("{", 1)
            kept = [pair for pair in labels.split(",") if not pair.startswith("model_name=")]
            key = name + ("{" + ",".join(kept) + "}" if kept else "")
        values[key] = float(value)
    return values


def engine_drained(base_url: str) -> dict[str, float] | None:
    metrics = get_metrics(base_url)
    drained = (
        metrics["pagellm:num_requests_running"] == 0
        and metrics["pagellm:num_requests_waiting"] == 0
        and metrics["pagellm:num_unfinished_requests"] == 0
        and metrics["pagellm:num_free_blocks"] == metrics["pagellm:num_usable_blocks"]
    )
    return metrics if drained else None
