"""The llama.cpp peer runs in a child process of its own (bench/llamacpp_backend.py
run_llamacpp_isolated): a backend that crashes is reported with its signal and the caller
goes on; a backend's own error and its result come back as they are."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pagellm.bench.backends import BackendResult
from pagellm.bench.llamacpp_backend import run_llamacpp_isolated
from pagellm.errors import PagellmError
from pagellm.workload.synthetic import BenchRequest

REQUESTS = [BenchRequest(prompt_token_ids=[1, 2, 3], output_len=2)]


# Module-level, so the spawned child can import them (it gets the parent's sys.path).
def crashing_backend(requests, model_path, parallel, n_batch, repeats):  # noqa: ANN001, ANN201
    os.kill(os.getpid(), signal.SIGSEGV)  # as llama.cpp's AMX path did in its first decode


def failing_backend(requests, model_path, parallel, n_batch, repeats):  # noqa: ANN001, ANN201
    raise PagellmError("llama.cpp could not load model.gguf")


def working_backend(requests, model_path, parallel, n_batch, repeats):  # noqa: ANN001, ANN201
    return BackendResult("llamacpp", 0.5, 2, 3, settings={"parallel": parallel, "pid": os.getpid()},
                         output_token_ids=[[7, 8]])  # fmt: skip


def test_a_crash_is_this_backends_failure_with_its_signal():
    with pytest.raises(PagellmError, match="killed by signal SIGSEGV"):
        run_llamacpp_isolated(REQUESTS, Path("model.gguf"), 4, target=crashing_backend)
    # ... and this process goes on: the next backend runs.
    result = run_llamacpp_isolated(REQUESTS, Path("model.gguf"), 4, target=working_backend)
    assert result.output_token_ids == [[7, 8]] and result.settings["parallel"] == 4
    assert result.settings["pid"] != os.getpid()  # it did run elsewhere


def test_the_backends_own_error_comes_back():
    with pytest.raises(PagellmError, match="could not load model.gguf"):
        run_llamacpp_isolated(REQUESTS, Path("model.gguf"), 1, target=failing_backend)
