"""Entrypoints stage: data parallelism: the engine replicas behind one API server.

Each replica is a whole `pagellm serve` (its own engine, KV cache and, with
--tensor-parallel-size, its own worker processes) listening on a private port; the
router in front speaks HTTP to it. `mp` starts the replicas as processes on this
machine; `ray` starts each one from a Ray actor, so the cluster places them on any node
(one bundle of CPUs or GPUs per replica) and they listen on their node's address.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagellm.errors import ConfigError

logger = logging.getLogger(__name__)

READY_MARK = "pagellm is ready: model "
START_TIMEOUT_S = 600.0


class Replica(ABC):
    index: int
    url: str  # http://host:port

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Ask the replica to shut down gracefully; kill it if it does not within timeout_s."""


class ProcessReplica(Replica):
    """`python -m pagellm.entrypoints.cli serve ...` as a child process; its log lines are
    passed on, prefixed with the replica's index."""

    def __init__(
        self,
        index: int,
        serve_args: Sequence[str],
        num_threads: int | None,
        host: str = "127.0.0.1",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.index = index
        env = {**os.environ, **(extra_env or {})}
        if num_threads is not None:
            env["OMP_NUM_THREADS"] = str(num_threads)
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--host", host, "--port", "0", *serve_args,
                   "--data-parallel-rank", str(index)]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.url = ""
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._pass_log, name=f"pagellm-replica{index}-log", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        if not self._ready.wait(timeout_s) or not self.url:
            self.stop(1.0)
            raise ConfigError(
                f"data-parallel replica {self.index} did not start (exit code {self.process.poll()}); "
                "its log lines above say why"
            )

    def _pass_log(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            if READY_MARK in line and not self.url:
                # "... at http://HOST:PORT/v1 (KV cache ...": only the router's own line
                # says "pagellm is ready", so that scripts watching the log find its address.
                self.url = line.split(" at ", 1)[1].split("/v1", 1)[0]
                line = f"replica up at {self.url}/v1, pid {self.process.pid} ({line.split(' (', 1)[-1]}"
                self._ready.set()
            print(f"[replica {self.index}] {line}", file=sys.stderr, flush=True)
        self._ready.set()  # the process ended: stop waiting

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5.0)


def start_process_replicas(
    num: int, serve_args: Sequence[str], total_threads: int, extra_env: dict[str, str] | None = None
) -> list[ProcessReplica]:
    """`num` replicas on this machine, the CPU threads split between them."""
    per_replica = max(1, total_threads // num)
    replicas = [ProcessReplica(i, serve_args, per_replica, extra_env=extra_env) for i in range(num)]
    try:
        for replica in replicas:
            replica.wait_ready()
    except BaseException:
        for replica in replicas:
            replica.stop(1.0)
        raise
    return replicas


class RayReplica(Replica):
    """A replica started by a Ray actor on whichever node the cluster picks; the actor
    owns the replica's process and reports its node-reachable address."""

    def __init__(self, index: int, actor: object, url: str) -> None:
        self.index = index
        self.url = url
        self._actor = actor

    def is_alive(self) -> bool:
        import ray

        try:
            return bool(ray.get(self._actor.is_alive.remote(), timeout=5.0))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the actor (or its node) is gone
            return False

    def stop(self, timeout_s: float) -> None:
        import ray

        try:
            ray.get(self._actor.stop.remote(timeout_s), timeout=timeout_s + 5.0)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - already gone
            pass
        try:
            ray.kill(self._actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


class _ReplicaActor:
    """Runs one replica's process on the actor's node (wrapped by ray.remote at run time)."""

    def __init__(self, index: int, serve_args: list[str], extra_env: dict[str, str]) -> None:
        # Reachable from the router's node, so it asks for the API key too (when set).
        self.replica = ProcessReplica(index, serve_args, None, host="0.0.0.0", extra_env=extra_env)

    def start(self) -> str:
        import ray

        self.replica.wait_ready()
        port = self.replica.url.rsplit(":", 1)[1]
        return f"http://{ray.util.get_node_ip_address()}:{port}"

    def is_alive(self) -> bool:
        return self.replica.is_alive()

    def stop(self, timeout_s: float) -> None:
        self.replica.stop(timeout_s)


def start_ray_replicas(
    num: int, serve_args: Sequence[str], gpus_per_replica: int, extra_env: dict[str, str] | None = None
) -> list[RayReplica]:
    from pagellm.executor.ray_executor import require_ray

    ray = require_ray()
    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING, configure_logging=False)
    # A replica's own tensor-parallel ranks are its process's children on its node.
    options = {"num_cpus": 1, "num_gpus": gpus_per_replica} if gpus_per_replica else {"num_cpus": 1}
    actor_class = ray.remote(**options)(_ReplicaActor)
    actors = [actor_class.remote(i, list(serve_args), dict(extra_env or {})) for i in range(num)]
    try:
        urls = ray.get([actor.start.remote() for actor in actors])
    except Exception as e:
        for actor in actors:
            ray.kill(actor)
        raise ConfigError(f"a data-parallel replica failed to start on the Ray cluster: {e}") from None
    return [RayReplica(i, actor, url) for i, (actor, url) in enumerate(zip(actors, urls, strict=True))]
