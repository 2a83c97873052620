"""Engine stage: what the resolver needs to know about this machine, found out here.

Only what the arguments make relevant is probed: whether the native CPU kernels run is
asked (which may compile them) only where dtype auto on a CPU depends on it.
"""

from __future__ import annotations

import os

import torch

from pagellm.config.engine_args import EngineArgs
from pagellm.config.engine_config import DeviceFacts


def probe_device_facts(args: EngineArgs) -> DeviceFacts:
    cuda_available = torch.cuda.is_available()
    on_cpu = args.device == "cpu" or (args.device == "auto" and not cuda_available)
    cpu_dtype_override = os.environ.get("PAGELLM_CPU_DTYPE") or None
    runs_native = False
    if on_cpu and args.dtype == "auto" and cpu_dtype_override is None:
        from pagellm.kernels.linear_bindings import cpu_linear_kernels

        runs_native = cpu_linear_kernels() is not None
    return DeviceFacts(
        cuda_available=cuda_available,
        cpu_runs_native_kernels=runs_native,
        cpu_dtype_override=cpu_dtype_override,
        num_cpu_threads=torch.get_num_threads(),
    )
