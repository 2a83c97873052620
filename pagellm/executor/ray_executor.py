"""Executor stage: the other tensor-parallel ranks as Ray actors, on any node of a Ray cluster.

`ray start --head` on one machine, `ray start --address=<head>:6379` on the others, then
`pagellm serve --distributed-executor-backend ray --tensor-parallel-size N` on the head:
the engine joins the running cluster (or starts a local one when there is none), reserves
one bundle per rank in a placement group (a GPU each on CUDA, packed onto as few nodes as
possible) and starts one actor per rank besides the driver. Ray only places and watches
the processes: the model's collectives and the per-step broadcast run over
torch.distributed, exactly as with the `mp` executor.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from pagellm.errors import ConfigError
from pagellm.executor.base import WorkerDiedError
from pagellm.executor.distributed_executor import DistributedExecutor
from pagellm.executor.worker_loop import local_init_method, serve_driver
from pagellm.config.engine_config import EngineConfig
from pagellm.structured.grammar_compiler import GrammarCompiler
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)

# How long the placement group may wait for the cluster to offer its bundles.
_PLACEMENT_TIMEOUT_S = 300.0


def require_ray() -> Any:
    """The ray module, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--distributed-executor-backend ray needs Ray: pip install 'pagellm[ray]' "
            "(or use the default mp backend on one machine)"
        ) from None
    return ray


class _RankActor:
    """One non-driver rank inside a Ray actor (wrapped by ray.remote at run time)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def load(self, config: EngineConfig, rank: int, device_type: str) -> None:
        # Ray gives a GPU actor exactly its own GPU (CUDA_VISIBLE_DEVICES): cuda:0 here.
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        self.worker = Worker(config, rank, device)

    def serve(self, init_method: str) -> None:
        assert self.worker is not None, "load first"
        serve_driver(self.worker, init_method)


class _GpuHolder:
    """Holds the driver's GPU in Ray's accounting (the driver is not an actor)."""

    def gpu_id(self) -> int:
        import ray

        return int(ray.get_gpu_ids()[0])


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, device: torch.device, grammars: GrammarCompiler | None = None) -> None:
        ray = require_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        if not ray.is_initialized():
            # Joins the cluster `ray start` made on this machine, or starts a local one.
            ray.init(logging_level=logging.WARNING, configure_logging=False)
        size = config.parallel_config.tensor_parallel_size
        on_gpu = device.type == "cuda"
        bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else {"CPU": 1.0}
        bundles = [dict(bundle) for _ in range(size - 1)]
        if on_gpu:
            # The driver (this process) needs a GPU of this node that no actor gets:
            # bundle 0, pinned here, is held for it by a placeholder actor.
            here = f"node:{ray.util.get_node_ip_address()}"
            bundles.insert(0, {**bundle, here: 0.001})
        self._group = placement_group(bundles, strategy="PACK")
        self._remove_group = remove_placement_group
        first_worker_bundle = 1 if on_gpu else 0
        ready, _ = ray.wait([self._group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self._group)
            raise ConfigError(
                f"the Ray cluster cannot place {size - 1} worker(s) of {bundle} within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})"
            )
        def in_bundle(index: int) -> Any:
            return PlacementGroupSchedulingStrategy(placement_group=self._group, placement_group_bundle_index=index)

        actor_class = ray.remote(num_cpus=1, num_gpus=1 if on_gpu else 0)(_RankActor)
        self._actors = [
            actor_class.options(scheduling_strategy=in_bundle(first_worker_bundle + rank - 1)).remote()
            for rank in range(1, size)
        ]
        self._serving: list[Any] = []
        try:
            if on_gpu:
                holder = ray.remote(num_cpus=0, num_gpus=1)(_GpuHolder).options(scheduling_strategy=in_bundle(0)).remote()
                self._actors.append(holder)
                device = torch.device("cuda", int(ray.get(holder.gpu_id.remote())))
            loads = [actor.load.remote(config, rank, device.type) for rank, actor in enumerate(self._actors[: size - 1], start=1)]
            driver = Worker(config, 0, device, grammars)
            init_method = local_init_method().replace("127.0.0.1", ray.util.get_node_ip_address())
            super().__init__(driver, init_method)
            self._wait(loads, "failed to start")
            self._serving = [actor.serve.remote(init_method) for actor in self._actors[: size - 1]]
            self._connect_driver()
        except BaseException:
            self._kill_actors()
            raise
        self._monitor = threading.Thread(target=self._watch, name="pagellm-ray-monitor", daemon=True)
        self._monitor.start()

    def _wait(self, refs: list[Any], what: str) -> None:
        for rank, ref in enumerate(refs, start=1):
            try:
                self._ray.get(ref)
            except Exception as e:  # noqa: BLE001 - Ray wraps the rank's own error
                raise WorkerDiedError(f"tensor-parallel rank {rank} (Ray actor) {what}: {e}") from None

    def _watch(self) -> None:
        self._ray.wait(self._serving, num_returns=1, timeout=None)
        if not self._closing.is_set():
            report = self._death_report()
            if report is not None:
                self._fail(report)

    def _death_report(self) -> WorkerDiedError | None:
        done, _ = self._ray.wait(self._serving, num_returns=1, timeout=2.0)
        if not done:
            return None
        rank = self._serving.index(done[0]) + 1
        try:
            self._ray.get(done[0])
            how = "stopped serving"
        except Exception as e:  # noqa: BLE001 - ActorDiedError, a RayTaskError, ...
            how = f"died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return WorkerDiedError(f"tensor-parallel worker rank {rank} (Ray actor) {how}")

    def _stop_workers(self) -> None:
        if self._serving and self.dead_error is None:
            self._ray.wait(self._serving, num_returns=len(self._serving), timeout=10.0)
        self._kill_actors()

    def _kill_actors(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            self._remove_group(self._group)
        except Exception:  # noqa: BLE001 - already removed
            pass
