"""Executor stage: pick the executor for the engine's settings."""

from __future__ import annotations

import torch

from pagellm.config.engine_config import EngineConfig
from pagellm.executor.base import Executor, UniProcExecutor
from pagellm.structured.grammar_compiler import GrammarCompiler
from pagellm.worker.worker import Worker


def create_executor(config: EngineConfig, grammars: GrammarCompiler | None = None) -> Executor:
    """One rank in this process, or `tensor_parallel_size` ranks placed by the
    distributed executor backend ("mp": processes on this machine, the default; "ray":
    Ray actors, any machines of a Ray cluster). The driver (rank 0, in this process)
    gets `grammars`, the engine's structured-output compiler."""
    parallel = config.parallel_config
    device = torch.device(config.device_type)
    if parallel.distributed_executor_backend == "ray":
        from pagellm.executor.ray_executor import RayExecutor, require_ray

        require_ray()
        if parallel.tensor_parallel_size > 1:
            return RayExecutor(config, device, grammars)
    # One rank is the driver alone: it always runs in the engine's process.
    if parallel.tensor_parallel_size == 1:
        return UniProcExecutor(Worker(config, 0, device, grammars))
    from pagellm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, device, grammars)
