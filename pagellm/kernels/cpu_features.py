"""Kernels stage: CPU: what this processor is and which instruction sets oneDNN uses on it.

The native kernels are compiled once per instruction-set level and the level is chosen at
run time by CPUID (kernels/build.py, which also names the build that loaded:
`native_isa`, `describe_isa`); oneDNN, under torch's F.linear, dispatches at run time too
and uses AMX tiles for bf16 where the CPU has them. Both are named in the startup log, the
kernel benchmark and /metrics. This module reads the CPU only: build.py keys its cache by
`cpu_signature`, so nothing here imports the build.
"""

from __future__ import annotations

import functools
import os
import platform

# The instruction sets that decide which kernels can run, highest first.
_ISA_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx512f", "avx2", "fma")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and ":" in line:
                    flags = frozenset(line.split(":", 1)[1].split())
                if flags and model:
                    break
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def isa_flags() -> list[str]:
    """The instruction sets of _ISA_FLAGS this CPU has."""
    flags = _cpuinfo()[1]
    return [flag for flag in _ISA_FLAGS if flag in flags]


def cpu_signature() -> str:
    """What a measured choice is valid for: the model name and every feature flag."""
    model, flags = _cpuinfo()
    return f"{model}|{platform.machine()}|{' '.join(sorted(flags))}"


def onednn_isa() -> str:
    """What torch's matmuls run on: its CPU capability, with AMX where the CPU has it."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()  # oneDNN's own cap, as users set it
    amx = "amx_bf16" in _cpuinfo()[1] and (limit == "ALL" or "AMX" in limit)
    return f"{capability} + AMX-BF16" if amx else capability
