"""Bench stage: a peer engine's OpenAI-compatible server (vLLM's `vllm serve`) as a child
process, for the online comparisons that load it with `pagellm bench serve`'s generator.

The server runs from the peer's own environment (bench/peers.py) in a session of its own;
it is ready when GET /v1/models answers with a model (polled with a short timeout, within a
bounded total wait); it is stopped with SIGINT (its graceful shutdown), then killed with
every process it started. A server that exits or never answers is a PagellmError quoting
the end of its output. Its memory is read from /proc: the peak resident set (VmHWM) of
each of its processes, summed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagellm.bench.peers import output_tail
from pagellm.errors import PagellmError

logger = logging.getLogger(__name__)

# Lines of a failed server's output quoted in the error.
_TAIL_LINES = 12
# Environment of a vLLM CPU server: the same fit to a small machine as the offline runner's
# defaults (peer_runners/vllm_runner.py): a 4 GiB KV cache, as pagellm's CPU default, and
# every core computing. VLLM_CPU_NUM_OF_RESERVED_CPU=1 is vLLM's own choice for serving.
VLLM_SERVER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def vllm_server_command(python: Path, model_folder: Path, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    """`vllm serve <folder>` run by the vLLM environment's Python, on 127.0.0.1:port."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
            "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats", *extra_args]  # fmt: skip


def vllm_server_env(python: Path) -> dict[str, str]:
    """VLLM_SERVER_ENV, and Intel's OpenMP of the environment preloaded as vLLM's CPU guide
    advises (the offline runner does the same)."""
    env = dict(VLLM_SERVER_ENV)
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


class PeerServer:
    """`command` (a server listening on 127.0.0.1:`port`) started and ready.

    Raises PagellmError, with the end of the server's output, if it exits or its
    /v1/models does not answer within `start_timeout_s`; nothing of it is left running then.
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        port: int,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 600.0,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self._log = tempfile.NamedTemporaryFile(prefix=f"pagellm-{name}-server-", suffix=".log", delete=False)
        logger.info("starting %s: %s (output in %s)", name, " ".join(command), self._log.name)
        try:
            self.process = subprocess.Popen(
                list(command), stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise PagellmError(f"{name} server could not be started ({command[0]}): {e}") from None
        started = time.monotonic()
        try:
            self._wait_ready(started + start_timeout_s, poll_interval_s)
        except BaseException:
            self._kill()
            raise
        self.start_s = time.monotonic() - started
        logger.info("%s is ready at %s after %.1f s", name, self.url, self.start_s)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, deadline: float, poll_interval_s: float) -> None:
        while True:
            status = self.process.poll()
            if status is not None:
                how = f"killed by signal {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
                raise PagellmError(f"{self.name} server {how} before it was ready: {self.output_tail()}")
            if self.model_names():
                return
            if time.monotonic() >= deadline:
                raise PagellmError(
                    f"{self.name} server did not answer {self.url}/v1/models in time; stopped: {self.output_tail()}"
                )
            time.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))

    def model_names(self) -> list[str]:
        """The models the server lists, or [] while it does not answer."""
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2.0) as response:
                payload: Any = json.load(response)
        except (OSError, ValueError):  # refused, timed out, not JSON yet
            return []
        return [str(m.get("id")) for m in payload.get("data") or [] if isinstance(m, dict)]

    def output_tail(self) -> str:
        return output_tail(Path(self._log.name).read_text(errors="replace"), _TAIL_LINES)

    def peak_rss_bytes(self) -> int:
        """The peak resident set of the server and each process it started, summed (an
        upper bound of the peak of the whole: shared pages count once per process)."""
        return process_tree_peak_rss(self.pid)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (a graceful shutdown), then SIGKILL to every process of the server after
        `timeout_s`; the server's exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s server did not stop within %.0f s of SIGINT: killed", self.name, timeout_s)
        return self._kill()

    def _kill(self) -> int | None:
        if self._log.closed:  # stopped before
            return self.process.returncode
        try:
            # The session: its children too (Linux reuses no id while a group bears it).
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = self.process.wait()
        self._log.close()
        os.unlink(self._log.name)
        return status

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_tree_peak_rss(pid: int) -> int:
    """VmHWM (peak resident set) of `pid` and of each of its live descendants, summed, in
    bytes (0 when the process is gone)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                # The name (field 2) may hold spaces; the parent id follows its ')'.
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [pid], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        tree += frontier
    total = 0
    for member in tree:
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024  # kB
        except OSError:
            continue
    return total
