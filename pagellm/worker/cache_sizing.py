"""Worker stage: how many KV blocks fit, from the memory budget the user allows."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pagellm.errors import ConfigError

logger = logging.getLogger(__name__)

GiB = 1 << 30
# On CPU the "device" memory is the machine's RAM, shared with everything else: the KV
# cache gets a fixed budget (like vLLM's CPU backend) rather than a fraction of all RAM.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB


@dataclass(frozen=True)
class CacheSize:
    num_gpu_blocks: int  # including the reserved null block 0
    num_cpu_blocks: int
    kv_cache_bytes: int
    how: str  # how the size was decided, for the start-up log


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def decide_cache_size(
    *,
    bytes_per_block: int,
    device: torch.device,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    num_gpu_blocks_override: int | None,
    swap_space_bytes: int,
    profiled_peak_bytes: int | None = None,
) -> CacheSize:
    """Number of device and host blocks.

    Order of precedence: num_gpu_blocks_override, kv_cache_memory_bytes, then the
    device's budget (GPU: gpu_memory_utilization of total memory minus what the
    profiling forward measured as used at peak; CPU: a fixed default budget, at most half
    of the RAM available now).
    """
    num_cpu_blocks = swap_space_bytes // bytes_per_block
    if num_gpu_blocks_override is not None:
        num = num_gpu_blocks_override
        how = "num_gpu_blocks_override"
    else:
        if kv_cache_memory_bytes is not None:
            budget, how = kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            used = profiled_peak_bytes or 0
            budget = int(total * gpu_memory_utilization) - used
            how = (
                f"gpu_memory_utilization={gpu_memory_utilization} of {total / GiB:.1f} GiB "
                f"minus {used / GiB:.2f} GiB peak use (weights + activations)"
            )
            if budget <= 0:
                raise ConfigError(
                    f"no memory left for the KV cache: weights and activations take "
                    f"{used / GiB:.2f} GiB, more than gpu_memory_utilization="
                    f"{gpu_memory_utilization} of {total / GiB:.1f} GiB; raise "
                    "gpu_memory_utilization or lower max_num_batched_tokens"
                )
        else:
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, available_ram_bytes() // 2)
            how = f"CPU default budget ({budget / GiB:.2f} GiB)"
        # +1: block 0 is the reserved null block and holds no tokens.
        num = budget // bytes_per_block + 1
    if num < 2:
        raise ConfigError(
            f"the KV cache budget ({how}) is smaller than one block of {bytes_per_block} bytes"
        )
    return CacheSize(num, num_cpu_blocks, (num - 1) * bytes_per_block, how)
