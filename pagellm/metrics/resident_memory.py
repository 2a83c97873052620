"""Metrics stage: where this process's resident memory went while the engine started.

A CPU user sees one number, the resident set (RSS), and asks what it holds: for a 92 MiB
model it is several times that. The engine reads the kernel's own accounting
(/proc/self/status: anonymous, file-backed and shared pages) at each stage of its start,
and the startup log names what each stage added: the interpreter and libraries (torch
alone is ~200 MiB), the tokenizer and the checkpoint's metadata, the weights, the KV
cache. The KV cache is reserved, not touched: its pages become resident as blocks are
first written (they are shared memory, so they show as RssShmem), which is why the RSS of
a serving process grows with the tokens it holds, up to the cache's size.

Linux only; elsewhere every reading is None and nothing is logged. Torch-free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class ResidentMemory:
    """One reading of /proc/self/status, in bytes."""

    total: int  # VmRSS
    anonymous: int  # RssAnon: heaps, torch tensors, Python objects
    file_backed: int  # RssFile: code and mapped files (libraries, a checkpoint's mapping)
    shared: int  # RssShmem: shared memory (the KV cache's touched pages)
    peak: int  # VmHWM

    def describe(self) -> str:
        return (
            f"{self.total / MiB:.0f} MiB (anonymous {self.anonymous / MiB:.0f}, file-backed "
            f"{self.file_backed / MiB:.0f}, shared {self.shared / MiB:.0f}; peak so far {self.peak / MiB:.0f})"
        )


def read_resident_memory() -> ResidentMemory | None:
    """This process's resident memory now, or None where /proc says nothing."""
    wanted = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "RssShmem": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in wanted:
                    wanted[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if not wanted["VmRSS"]:
        return None
    return ResidentMemory(wanted["VmRSS"], wanted["RssAnon"], wanted["RssFile"], wanted["RssShmem"], wanted["VmHWM"])


class StartupMemory:
    """Readings taken after each stage of the engine's start; describe() names what each
    stage added to the resident set."""

    def __init__(self) -> None:
        first = read_resident_memory()
        self._stages: list[tuple[str, ResidentMemory]] = [] if first is None else [("before", first)]

    def mark(self, stage: str) -> None:
        reading = read_resident_memory()
        if reading is not None and self._stages:
            self._stages.append((stage, reading))

    def describe(self) -> str | None:
        """e.g. 'resident 652 MiB: interpreter, torch and libraries 240 MiB, tokenizer ...'."""
        if len(self._stages) < 2:
            return None
        parts = [f"interpreter, torch and libraries {self._stages[0][1].total / MiB:.0f} MiB"]
        for (_, before), (stage, after) in zip(self._stages, self._stages[1:]):
            parts.append(f"{stage} {(after.total - before.total) / MiB:+.0f} MiB")
        return f"resident {self._stages[-1][1].describe()}: " + ", ".join(parts)


def return_freed_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): loading a
    checkpoint frees many mid-sized buffers (parsing, repacking) that glibc otherwise
    keeps as resident free space (~40 MiB for SmolLM2). A no-op elsewhere."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
