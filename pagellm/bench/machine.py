"""Bench stage: which CPU a result was measured on (model name and the ISA extensions that
decide which kernels run), recorded beside every figure so results from different
machines are never compared unknowingly.

No torch here: benchmarks/compare.py imports it for its header.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

# The extensions pagellm's and its peers' CPU kernels dispatch on (bf16 dot products,
# int8 dot products, AMX tiles), as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")

CPUINFO = Path("/proc/cpuinfo")


def cpu_info(cpuinfo_text: str | None = None) -> dict[str, Any]:
    """{"model": name, "isa_flags": [the ISA_FLAGS present]} of this machine's CPU.

    The name is /proc/cpuinfo's first "model name" (else platform.processor(), else
    "unknown"); flags come from its first "flags" line (none where there is no such file).
    `cpuinfo_text` replaces the file's contents (tests).
    """
    if cpuinfo_text is None:
        try:
            cpuinfo_text = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo_text = ""
    model = None
    flags: set[str] = set()
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {
        "model": model or platform.processor() or "unknown",
        "isa_flags": [flag for flag in ISA_FLAGS if flag in flags],
    }


def describe_cpu(info: dict[str, Any]) -> str:
    """One line for a header: `AMD EPYC 9454 (avx2 avx512f avx512_bf16)`."""
    flags = " ".join(info["isa_flags"]) or "no AVX2 / AVX-512 / AMX"
    return f"{info['model']} ({flags})"
