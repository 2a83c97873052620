"""The engine thread: the engine is built on the thread that steps it, and that thread
ends however the engine's life ends (never started, failed build, shutdown)."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm import EngineArgs, SamplingParams
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.engine_thread import EngineThread
from pagellm.engine.llm_engine import LLMEngine
from pagellm.errors import PagellmError

ENGINE = {"max_model_len": 64, "num_gpu_blocks_override": 32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-engine-thread"), "llama", seed=5))


def test_the_server_engine_is_built_and_stepped_on_one_thread(folder, monkeypatch):
    threads: dict[str, set[int]] = {"build": set(), "step": set()}
    build, step = LLMEngine.from_engine_args.__func__, LLMEngine.step

    def recording_build(cls, args):  # noqa: ANN001, ANN202
        threads["build"].add(threading.get_ident())
        return build(cls, args)

    def recording_step(self):  # noqa: ANN001, ANN202
        threads["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(recording_build))
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    llm = AsyncLLM.from_engine_args(EngineArgs(model=folder, **ENGINE))

    async def generate() -> list[int]:
        llm.start()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outputs = [out async for out in llm.generate([5, 6, 7], params, "r0")]
        await llm.shutdown()
        return outputs[-1].outputs[0].token_ids

    assert len(asyncio.run(asyncio.wait_for(generate(), 60))) == 4
    assert threads["build"] == threads["step"]
    assert threading.get_ident() not in threads["build"]
    assert not llm._thread.is_alive()


def test_a_failed_build_is_raised_to_the_caller_and_its_thread_ends(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(PagellmError, match="no-such-model"):
        AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path / "no-such-model")))
    new_threads = [t for t in threading.enumerate() if t not in before and t.name == "pagellm-engine"]
    for thread in new_threads:
        thread.join(10)
    assert not any(t.is_alive() for t in new_threads)


def test_an_engine_never_started_is_freed_and_its_thread_ends():
    class Engine:
        pass

    engine_thread = EngineThread(Engine)
    engine = engine_thread.result()
    engine_ref = weakref.ref(engine)
    thread = engine_thread.thread
    del engine, engine_thread
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert engine_ref() is None


def test_shutdown_of_an_engine_never_started_ends_its_thread(folder):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=folder, **ENGINE))
    thread = llm._engine_thread.thread
    asyncio.run(llm.shutdown())
    thread.join(10)
    assert not thread.is_alive()


def test_the_job_runs_on_the_building_thread():
    engine_thread = EngineThread(threading.get_ident)
    ran_on: list[int] = []
    engine_thread.run(lambda: ran_on.append(threading.get_ident()))
    engine_thread.thread.join(10)
    assert ran_on == [engine_thread.result()]
