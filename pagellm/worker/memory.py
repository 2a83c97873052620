"""Worker stage: what a CPU rank can measure of the machine's memory."""

from __future__ import annotations

import os


def available_ram_bytes() -> int:
    """RAM available to new allocations now (MemAvailable), for the CPU cache budget."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
