"""Kernel builds under a lock (kernels/build.py `_build_lock`): a process that finds no
library takes the build's lock, and one that had to wait for it finds the library built and
loads it instead of compiling it again (a test run's two workers, or tensor-parallel ranks,
starting together used to compile the same build side by side on the same cores)."""

from __future__ import annotations

import fcntl
import shutil
import threading

import pytest

from pagellm.kernels import build


def test_a_process_that_waited_for_the_lock_loads_instead_of_building(tmp_path, monkeypatch):
    compiler = build._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    source = tmp_path / "probe.c"
    source.write_text("int answer(void) { return 42; }\n")
    ready = tmp_path / "ready.so"  # the library the holder of the lock "builds"
    build._build(compiler, [source], ("-O0", "-fPIC"), ready)

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    builds: list[object] = []
    monkeypatch.setattr(build, "_build", lambda *args: builds.append(args))
    waiting = threading.Event()
    real_flock = fcntl.flock

    def flock(handle, operation):  # noqa: ANN001, ANN202
        if operation == fcntl.LOCK_EX and threading.current_thread().name == "second":
            waiting.set()  # past its first look for the library, about to wait for the lock
        return real_flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    name, flags = "pagellm_lock_test", ("-O0", "-fPIC")
    loaded = {}

    def second() -> None:
        loaded["library"] = build._compiled(compiler, name, [source], [], flags)

    # Hold the lock as a builder would, then let a second caller find no library and wait.
    target = build._library_path(compiler, name, [source], [], flags)
    with build._build_lock(target):
        thread = threading.Thread(target=second, name="second")
        thread.start()
        assert waiting.wait(timeout=60)
        shutil.copy(ready, target)  # the holder's build lands
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert builds == []  # the waiter loaded the holder's library: no second compile
    assert loaded["library"].answer() == 42
