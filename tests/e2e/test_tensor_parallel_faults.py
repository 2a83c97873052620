"""A tensor-parallel worker that dies: in-flight requests fail with a clear error naming
the rank, and the engine refuses further work instead of hanging (the server's side is
tests/entrypoints/openai/test_openai_worker_faults.py)."""

import os
import signal
import threading
import time

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.executor.base import WorkerDiedError

LONG = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=2048))


def kill_when_stepping(llm, pid: int, after_steps: int = 5) -> threading.Thread:
    def watch() -> None:
        while llm.engine.num_steps < after_steps:
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_offline_generation_fails_with_the_dead_rank_named(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, max_model_len=2048)
    (pid,) = llm.engine.executor.worker_pids
    killer = kill_when_stepping(llm, pid)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) died \(signal 9\)"):
        llm.generate([[5, 6, 7]] * 4, LONG, use_tqdm=False)
    assert time.monotonic() - started < 60
    killer.join()
    # The engine refuses at once rather than hang on the missing rank.
    with pytest.raises(WorkerDiedError):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
