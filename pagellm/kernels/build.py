"""Kernels stage: CPU: build and load the C kernels in csrc/ (attention, linear layers, decoder layers) with the machine's compiler.

The kernels are compiled from the same sources once per instruction-set level (ISA_LEVELS:
AVX2+FMA, AVX-512, AVX-512 BF16/VNNI, AMX), each on first use (a few seconds) into a cache
folder keyed by the source, the flags, the compiler and the CPU (one process builds under a
lock, others starting together wait for its library), and loaded with ctypes.
Which level runs is decided at run time by CPUID (csrc/isa_probe.c, built for baseline
x86-64): the highest one this CPU and its operating system allow, or the one
PAGELLM_KERNEL_ISA names (tests run every level the host can execute; users may pin one).
Where no compiler works, the CPU has no AVX2 (or is not x86-64), or PAGELLM_NATIVE_KERNELS=0,
`load_kernels()` returns None and the caller keeps the plain PyTorch path.

The library links libgomp by soname, so it shares the OpenMP runtime torch has already
loaded: one thread pool, no two pools spinning against each other. It binds its own
symbols (-Bsymbolic), so that several levels can be loaded side by side in one process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pagellm.errors import ConfigError
from pagellm.kernels import abi, codebooks, cpu_features

logger = logging.getLogger(__name__)

_SOURCES = ("linear_f32.c", "paged_decode.c", "paged_decode_bf16.c", "paged_decode_avx2.c", "small_linear.c", "gemm_bf16.c", "gemm_amx.c", "linear.c", "linear_bf16.c", "quant_linear.c", "quant_int8.c", "quant_int8_k.c", "quant_int8_q8.c", "decode_layer.c", "layer_ops.c", "hybrid_layer_ops.c", "hybrid_decode_layer.c", "moe_experts.c", "lora.c", "token_masks.c", "gated_delta.c", "codebooks.c", "abi.c")
_HEADERS = ("bf16.h", "float_mode.h", "fp8.h", "kernels.h", "layer_rows.h", "layer_structs.h", "quant_groups.h", "weights.h", "hybrid_rows.h")  # included by the sources: part of what the cached library is keyed by
_COMPILE_FLAGS = ("-O3", "-mtune=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11", "-Wall")
# Linked without -ffast-math: with it, GCC adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (every float computation, not just these kernels).
_LINK_FLAGS = ("-shared", "-fopenmp", "-Wl,-Bsymbolic")
_C_INT64_P = ctypes.POINTER(ctypes.c_int64)


@dataclasses.dataclass(frozen=True)
class IsaLevel:
    """One build of the kernels: the instruction sets its compiler flags allow."""

    name: str
    flags: tuple[str, ...]
    bf16_hardware: bool  # bf16 dot products in hardware (else the kernels compute bf16 inputs in float32)


# Lowest first; the index is what csrc/isa_probe.c's cpu_isa_level() returns.
ISA_LEVELS = (
    IsaLevel("avx2", ("-march=x86-64-v3",), False),  # AVX2, FMA, F16C (Haswell, Zen 1 and later)
    IsaLevel("avx512", ("-march=x86-64-v4",), False),  # AVX-512 F/BW/DQ/VL (Skylake-SP and later)
    IsaLevel("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), True),  # Cooper Lake, Zen 4
    IsaLevel("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"), True),
)
_LEVELS_BY_NAME = {level.name: level for level in ISA_LEVELS}


def _cache_dir() -> Path:
    root = os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm"
    )
    return Path(root) / "kernels"


def kernel_cache_dir() -> Path:
    """Where the compiled kernels and the measured kernel choices are kept."""
    return _cache_dir()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, sources: list[Path], flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never see half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [str(Path(scratch) / (source.stem + ".o")) for source in sources]
        # One compiler process per core: a level's build takes seconds, and tests build several.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(_run, ([compiler, *flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, objects))))
        partial = Path(scratch) / target.name
        _run([compiler, *_LINK_FLAGS, *objects, "-o", str(partial), "-lm"])
        os.replace(partial, target)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)


def _library_path(compiler: str, name: str, sources: list[Path], headers: list[Path], flags: tuple[str, ...]) -> Path:
    """Where the library built from `sources` with `flags` lies in the cache."""
    digest = hashlib.sha256()
    # The CPU is part of the key: -mtune=native, and a cache folder shared between machines.
    for part in (compiler, " ".join(flags + _LINK_FLAGS), cpu_features.cpu_signature(), platform.python_implementation()):
        digest.update(part.encode())
    for source in sources + headers:
        digest.update(source.read_bytes())
    return _cache_dir() / f"{name}_{digest.hexdigest()[:16]}.so"


def _compiled(compiler: str, name: str, sources: list[Path], headers: list[Path], flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library built from `sources` with `flags`, compiled into the cache if not there yet."""
    target = _library_path(compiler, name, sources, headers, flags)
    if not target.exists():
        with _build_lock(target):
            if not target.exists():  # another process may have built it while this one waited
                logger.info("compiling CPU kernels into %s", target)
                _build(compiler, sources, flags, target)
    return ctypes.CDLL(str(target))


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Held while one process builds `target`: processes starting together (a test run's
    workers, tensor-parallel ranks, data-parallel replicas) build it once and the others wait
    for it, instead of each compiling the same library on the same cores. Where the platform
    has no fcntl the builds stay unlocked (their atomic rename keeps them correct)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _csrc(names: tuple[str, ...]) -> list[Path]:
    return [Path(__file__).with_name("csrc") / name for name in names]


@functools.cache
def host_isa_levels() -> tuple[str, ...]:
    """The kernel builds this CPU can run, lowest first (empty: none, or no compiler)."""
    compiler = _compiler()
    if compiler is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    try:
        probe = _compiled(compiler, "pagellm_isa_probe", _csrc(("isa_probe.c",)), [], ("-O2", "-fPIC"))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("CPU kernels unavailable (%s): using the PyTorch path", _detail(error))
        return ()
    probe.cpu_isa_level.restype = ctypes.c_int
    return tuple(level.name for level in ISA_LEVELS[: probe.cpu_isa_level() + 1])


def selected_isa_level() -> IsaLevel | None:
    """The build load_kernels() loads: PAGELLM_KERNEL_ISA's, else the highest the CPU runs."""
    forced = os.environ.get("PAGELLM_KERNEL_ISA", "auto")
    if forced != "auto" and forced not in _LEVELS_BY_NAME:
        raise ConfigError(f"PAGELLM_KERNEL_ISA must be auto or one of {', '.join(_LEVELS_BY_NAME)}, got {forced!r}")
    levels = host_isa_levels()
    if not levels:  # no compiler, or no AVX2: the warning has said which
        return None
    if forced == "auto":
        return _LEVELS_BY_NAME[levels[-1]]
    if forced not in levels:
        raise ConfigError(f"PAGELLM_KERNEL_ISA={forced}: this CPU cannot run that build (it runs {', '.join(levels)})")
    return _LEVELS_BY_NAME[forced]


def _detail(error: Exception) -> str:
    return (getattr(error, "stderr", "") or str(error)).strip()[:500]


def clear_caches() -> None:
    """Forget the probed levels and loaded libraries (tests that change the compiler or cache)."""
    host_isa_levels.cache_clear()
    _load_level.cache_clear()


def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library for selected_isa_level(), or None where it cannot be built here."""
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        return None
    level = selected_isa_level()
    if level is None:
        if _compiler() is None:
            logger.warning("no C compiler found: CPU attention uses the slower PyTorch path")
        return None
    library = _load_level(level)
    if library is None and os.environ.get("PAGELLM_KERNEL_ISA", "auto") == "auto":
        # A compiler too old for the level's flags (AMX needs GCC 11): the next level down.
        for lower in reversed(ISA_LEVELS[: ISA_LEVELS.index(level)]):
            library = _load_level(lower)
            if library is not None:
                break
    return library


def native_isa() -> str:
    """The build of the native kernels that runs here (ISA_LEVELS), or "none"."""
    library = load_kernels()
    return library.isa_level.name if library is not None else "none"


def describe_isa() -> str:
    """The CPU, the native kernels' build and what oneDNN runs on, in one line."""
    return f"{cpu_features.cpu_model()}; native kernels {native_isa()}; oneDNN {cpu_features.onednn_isa()}"


@functools.cache
def _load_level(level: IsaLevel) -> ctypes.CDLL | None:
    try:
        library = _compiled(_compiler() or "cc", f"pagellm_kernels_{level.name}", _csrc(_SOURCES), _csrc(_HEADERS),
                            _COMPILE_FLAGS + level.flags)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("CPU kernels (%s) unavailable (%s): using the PyTorch path", level.name, _detail(error))
        return None
    abi.declare(library)
    abi.check_layout(library)  # a structure changed on one side only: refused, named
    codebooks.install(library)
    library.isa_level = level  # which build this is (native_isa)
    return library
