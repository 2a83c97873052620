"""Executor stage: pick the executor for the engine's settings."""

from __future__ import annotations

import torch

from pagellm.config import DISTRIBUTED_EXECUTOR_BACKENDS
from pagellm.errors import ConfigError
from pagellm.executor.base import Executor, UniProcExecutor
from pagellm.worker.worker import Worker, WorkerSpec


def create_executor(spec: WorkerSpec, backend: str | None, device: torch.device) -> Executor:
    """One rank in this process, or `spec.tensor_parallel_size` ranks placed by `backend`
    ("mp": processes on this machine, the default; "ray": Ray actors, any machines of a
    Ray cluster)."""
    if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ConfigError(
            f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, got {backend!r}"
        )
    if backend == "ray":
        from pagellm.executor.ray_executor import RayExecutor, require_ray

        require_ray()
        if spec.tensor_parallel_size > 1:
            return RayExecutor(spec, device)
    # One rank is the driver alone: it always runs in the engine's process.
    if spec.tensor_parallel_size == 1:
        return UniProcExecutor(Worker(spec, 0, device))
    from pagellm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, device)
