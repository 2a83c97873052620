"""Bench stage: a `pagellm serve` child process on a free port, for the benchmarks that load one.

The server picks its port (`--port 0`) and names its address in its ready line; its output
is collected (so that a failure to start can be shown), and `stop()` ends it gracefully.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

READY = re.compile(r"pagellm is ready: model '[^']*' at (http://[^/ ]+)/v1")


class ServerProcess:
    """`python -m pagellm.entrypoints.cli serve --port 0 [serve_args]`, started and ready.

    Raises RuntimeError, with the end of the server's
    output, if it exits or is not ready within `start_timeout_s`.
    """

    def __init__(
        self,
        serve_args: Sequence[str],
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", "0", *serve_args]
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
        )
        self.log: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.log.append(line)
                match = READY.search(line)
                if match and not self.url:
                    self.url = match.group(1)
                    ready.set()
            ready.set()  # the server exited

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(start_timeout_s) or not self.url:
            self.process.kill()
            self.process.wait()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-40:]))

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGINT (a graceful shutdown), then kill after `timeout_s`; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
