"""Kernels stage: CPU: how much of the machine other processes took while we measured.

A kernel choice timed while something else ran (a test suite, a build, a noisy neighbour
VM's steal time) is a choice for that moment, not for the machine: on a 2-core Zen 3 a
choice cached from a busy minute re-timed at 0.49 of the fastest candidate. So the
measurement is bracketed by two readings of the system's busy CPU time (/proc/stat,
steal included) and of this process's own CPU time; what the system spent beyond this
process, as a share of all CPUs over the wall time, is the disturbance. Where /proc/stat
does not exist the share is unknown (None) and the measurement is trusted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# Spans shorter than this many clock ticks of all CPUs together read too coarsely to judge.
MIN_SPAN_TICKS = 50
# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal ...
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (guest is inside user)


@dataclass(frozen=True)
class LoadReading:
    """One reading: wall clock, this process's CPU seconds, the system's busy CPU seconds."""

    wall: float
    own_cpu: float
    system_busy: float | None  # None where /proc/stat cannot be read


def system_busy_seconds(stat_path: str = "/proc/stat") -> float | None:
    """Busy CPU seconds of every CPU since boot, or None where unknown."""
    try:
        with open(stat_path, encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    try:
        ticks = [int(value) for value in fields[1:]]
    except ValueError:
        return None
    return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")


def read_load() -> LoadReading:
    return LoadReading(time.perf_counter(), time.process_time(), system_busy_seconds())


def others_share(before: LoadReading, after: LoadReading, num_cpus: int | None = None) -> float | None:
    """The share of all CPUs (0..1) that other processes used between two readings; None
    when unknown, or when the span is too short for /proc/stat's clock ticks (10 ms) to
    tell (under MIN_SPAN_TICKS of all CPUs together)."""
    if before.system_busy is None or after.system_busy is None:
        return None
    wall = after.wall - before.wall
    cpus = num_cpus or os.cpu_count() or 1
    if wall * cpus * os.sysconf("SC_CLK_TCK") < MIN_SPAN_TICKS:
        return None
    others = (after.system_busy - before.system_busy) - (after.own_cpu - before.own_cpu)
    return min(1.0, max(0.0, others / (wall * cpus)))
