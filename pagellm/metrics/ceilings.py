"""Metrics stage: the device's measured peaks (matmul FLOP/s, memory bandwidth).

Measured briefly (well under a second) once per process and device, so the engine can
put every step's work against them (metrics/utilization.py). PAGELLM_DEVICE_CEILINGS=
"<FLOP/s>,<bytes/s>" skips the measurement (for a known machine, or for tests).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from pagellm.kernels.cpu_load import others_share, read_load
from pagellm.metrics.utilization import Ceilings

logger = logging.getLogger(__name__)

# The share of the CPUs other processes may take while the peaks are measured before the
# measurement is called disturbed.
DISTURBED_SHARE = 0.25


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(work: float, run: object, device: torch.device, seconds: float) -> float:
    """Best work-per-second of `run()` over repeated calls for about `seconds`."""
    run()  # warm-up
    _sync(device)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        run()
        _sync(device)
        elapsed = time.perf_counter() - start
        best = max(best, work / elapsed)
        if time.perf_counter() >= deadline:
            return best


def measure_matmul_ceiling(
    dtype: torch.dtype = torch.float32, seconds: float = 1.5, size: int = 2048, device: str | torch.device = "cpu"
) -> float:
    """Best GFLOP/s of large square matmuls in `dtype` on this device (smaller ones where a
    large one would take longer than `seconds`: bf16 on a CPU without bf16 hardware falls
    back to a scalar loop, seconds per call)."""
    device = torch.device(device)

    def rate(n: int, seconds: float) -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        return _best_rate(2.0 * n**3, lambda: torch.mm(a, b), device, seconds)

    probe = min(size, 256)
    if 2.0 * size**3 / rate(probe, 0.0) > seconds / 4:  # a large call would outlast the measurement
        return rate(probe, seconds) / 1e9
    return rate(size, seconds) / 1e9


def model_matmul_ceiling(
    dtype: torch.dtype = torch.float32, seconds: float = 1.5, size: int = 2048, device: str | torch.device = "cpu"
) -> float:
    """The GFLOP/s ceiling of a model running in `dtype`: its matmuls', and on a CPU for
    bf16 also float32's, since a bf16 CPU model may compute in float32 (the kernels'
    float32 builds, oneDNN in float32), the faster of the two on a CPU without bf16
    arithmetic."""
    ceiling = measure_matmul_ceiling(dtype, seconds, size, device)
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        ceiling = max(ceiling, measure_matmul_ceiling(torch.float32, seconds, size, device))
    return ceiling


def measure_bandwidth(seconds: float = 0.3, megabytes: int = 256, device: str | torch.device = "cpu") -> float:
    """Best bytes/s of a large copy (bytes read plus bytes written)."""
    device = torch.device(device)
    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    return _best_rate(2.0 * source.numel() * 4, lambda: target.copy_(source), device, seconds)


@functools.cache
def device_ceilings(device: str, dtype: torch.dtype) -> Ceilings:
    """The peaks of `device` for matmuls in `dtype` and for memory traffic."""
    override = os.environ.get("PAGELLM_DEVICE_CEILINGS")
    if override:
        flops, moved = (float(x) for x in override.split(","))
        return Ceilings(flops, moved, "PAGELLM_DEVICE_CEILINGS")
    before = read_load()
    flops = model_matmul_ceiling(dtype, seconds=0.25, size=1024 if device == "cpu" else 4096, device=device) * 1e9
    # 64 MiB (twice the largest L3 of a CPU this runs on) measures memory, not cache, and keeps
    # the copy's two buffers (a transient 128 MiB of the start's peak RSS) small.
    moved = measure_bandwidth(seconds=0.15, megabytes=64 if device == "cpu" else 1024, device=device)
    others = others_share(before, read_load()) if device == "cpu" else None
    logger.info(
        "device ceilings (measured): %.0f GFLOP/s %s matmul, %.1f GB/s memory copy",
        flops / 1e9,
        str(dtype).removeprefix("torch."),
        moved / 1e9,
    )
    if others is not None and others > DISTURBED_SHARE:
        # Peaks measured on a busy machine read low, and utilization against them high;
        # the engine raises a ceiling to any rate it achieves (EngineMetrics).
        logger.warning(
            "other processes used %.0f%% of the CPUs while the device ceilings were measured: the ceilings may "
            "read low and utilization high until the engine's own rates correct them", 100 * others,
        )  # fmt: skip
        return Ceilings(flops, moved, "measured under load")
    return Ceilings(flops, moved, "measured")
