"""AsyncLLM: one engine thread, asyncio callers, aborts, shutdown and a dying engine."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.async_requests import EngineDeadError, EngineOverloadedError, NewRequest
from pagellm.errors import InvalidRequestError

ENGINE = {"max_model_len": 128, "num_gpu_blocks_override": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-async"), "llama", seed=4))


@pytest.fixture(scope="module")
def offline(folder: str) -> LLM:
    return LLM(folder, **ENGINE)


@pytest.fixture
def async_llm(folder: str) -> Iterator[AsyncLLM]:
    llm = AsyncLLM.from_engine_args(EngineArgs(model=folder, **ENGINE), max_num_queued_requests=4)
    yield llm
    if llm.is_alive:
        # Every test leaves the engine empty: no request, every block free.
        snapshot = llm.snapshot
        assert snapshot.num_unfinished_requests == 0
        assert snapshot.num_free_blocks == snapshot.num_usable_blocks


def run(coroutine):  # noqa: ANN001, ANN201
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


async def collect(llm: AsyncLLM, prompt: str | list[int], request_id: str) -> list:
    return [out async for out in llm.generate(prompt, GREEDY, request_id)]


async def settle(llm: AsyncLLM) -> None:
    """Let the engine thread take in what was sent (it publishes a snapshot per loop)."""
    for _ in range(200):
        if llm.snapshot.num_unfinished_requests == 0:
            return
        await asyncio.sleep(0.01)


def test_concurrent_requests_stream_the_offline_answers(async_llm, offline):
    prompts = ["alpha", "beta beta", [5, 6, 7, 8], "gamma"]
    expected = [o.outputs[0].text for o in offline.generate(prompts, GREEDY, use_tqdm=False)]

    async def main() -> list[list]:
        async_llm.start()
        try:
            return await asyncio.gather(
                *(collect(async_llm, p, f"r{i}") for i, p in enumerate(prompts))
            )
        finally:
            await async_llm.shutdown()

    streams = run(main())
    assert [s[-1].outputs[0].text for s in streams] == expected
    for stream in streams:
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        assert len(stream) == 12  # one output per step, each with one new token


def test_cancel_aborts_and_frees_blocks(async_llm):
    async def main() -> None:
        async_llm.start()
        stream = await async_llm.add_requests(
            [NewRequest("long", "x", SamplingParams(max_tokens=100, ignore_eos=True))]
        )
        first = await stream.__anext__()
        assert not first.finished
        stream.cancel()
        await settle(async_llm)
        snapshot = async_llm.snapshot
        assert snapshot.num_unfinished_requests == 0
        assert snapshot.num_free_blocks == snapshot.num_usable_blocks
        assert async_llm.engine.metrics.finished == {"abort": 1}
        # The engine still serves.
        outputs = await collect(async_llm, "after", "after")
        assert outputs[-1].outputs[0].finish_reason == "length"
        await async_llm.shutdown()

    run(main())


def test_a_group_is_added_all_or_none(async_llm):
    async def main() -> None:
        async_llm.start()
        group = [NewRequest("ok", "fine", GREEDY), NewRequest("bad", [1, 10**6], GREEDY)]
        with pytest.raises(InvalidRequestError) as err:
            await async_llm.add_requests(group)
        assert err.value.parameter == "prompt"
        await settle(async_llm)
        assert async_llm.snapshot.num_unfinished_requests == 0
        await async_llm.shutdown()

    run(main())


def test_queue_limit_refuses_what_does_not_fit(async_llm):
    """A group that would grow a non-empty waiting queue past the limit is refused."""

    async def main() -> None:
        # Added before the thread starts: it takes them all in before its first step, so
        # nothing leaves the waiting queue in between.
        params = SamplingParams(max_tokens=4)
        adds = [
            asyncio.ensure_future(async_llm.add_requests([NewRequest(f"q{i}", "x", params)]))
            for i in range(6)
        ]
        await asyncio.sleep(0)  # every add is queued now
        async_llm.start()
        results = await asyncio.gather(*adds, return_exceptions=True)
        refused = [r for r in results if isinstance(r, EngineOverloadedError)]
        accepted = [r for r in results if not isinstance(r, BaseException)]
        assert len(accepted) == 4 and len(refused) == 2
        assert "max-num-queued-requests=4" in str(refused[0])
        assert async_llm.engine.metrics.rejected == {"overloaded": 2}
        for stream in accepted:
            assert [o async for o in stream][-1].finished
        await async_llm.shutdown()

    run(main())


def test_shutdown_aborts_in_flight_and_refuses_new(async_llm):
    async def main() -> None:
        async_llm.start()
        stream = await async_llm.add_requests(
            [NewRequest("long", "x", SamplingParams(max_tokens=100, ignore_eos=True))]
        )
        await stream.__anext__()
        await async_llm.shutdown()
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert not async_llm.is_alive
        with pytest.raises(EngineDeadError):
            await async_llm.add_requests([NewRequest("late", "x", GREEDY)])

    run(main())


def test_a_dying_engine_fails_every_caller_instead_of_hanging(async_llm):
    async def main() -> None:
        async_llm.start()

        def broken_step():  # noqa: ANN202
            raise RuntimeError("device lost")

        # Broken before the request arrives: the engine thread steps as soon as it has the
        # request, so a step swapped in afterwards could come after all of its tokens.
        async_llm.engine.step = broken_step
        stream = await async_llm.add_requests([NewRequest("a", "x", GREEDY)])
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in stream:
                pass
        assert not async_llm.is_alive
        assert "device lost" in str(async_llm.dead_error)
        with pytest.raises(EngineDeadError):
            await async_llm.add_requests([NewRequest("b", "x", GREEDY)])
        async_llm.abort(["a"])  # harmless now
        await async_llm.shutdown()

    run(main())


def test_constraints_compile_before_they_reach_the_engine_thread(async_llm):
    """A bad constraint is refused to its caller (the engine never sees it); a good one is
    compiled off the engine thread, so the engine finds it cached."""
    from pagellm import StructuredOutputsParams
    from pagellm.engine.async_requests import NewRequest
    from pagellm.errors import InvalidRequestError

    good = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(open"))

    async def main() -> list:
        async_llm.start()
        try:
            with pytest.raises(InvalidRequestError) as error:
                await async_llm.add_requests([NewRequest("bad", [1, 2], bad)])
            assert error.value.parameter == "regex"
            compiles_before = async_llm.engine.grammars.stats.compiles
            outputs = [o async for o in async_llm.generate([3, 4], good, "good")]
            assert async_llm.engine.grammars.stats.compiles == compiles_before + 1
            return outputs
        finally:
            await async_llm.shutdown()

    outputs = run(main())
    # The byte tokenizer: the first three ids are the constrained bytes (then EOS).
    assert outputs[-1].finished and re.fullmatch(r"[ab]{3}", bytes(outputs[-1].outputs[0].token_ids[:3]).decode())


def test_retry_after_grows_with_the_queue_and_the_recent_request_time():
    """The overloaded answer's Retry-After: waiting requests over seats, times the recent
    mean request time, in 1-60 s."""
    from types import SimpleNamespace

    from pagellm.engine.async_llm import AsyncLLM

    def estimate(mean_s, waiting: int, seats: int = 4) -> int:
        fake = SimpleNamespace(engine=SimpleNamespace(
            metrics=SimpleNamespace(recent_mean=lambda name: mean_s),
            config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=seats)),
        ))  # fmt: skip
        return AsyncLLM._retry_after_s(fake, waiting)  # type: ignore[arg-type]

    assert estimate(None, 10) == 1
    assert estimate(2.0, 8) == 4 and estimate(2.0, 9) == 5
    assert estimate(0.01, 1) == 1 and estimate(100.0, 100) == 60


def test_an_idle_timer_the_engine_cannot_honour_turns_itself_off(folder, offline):
    """Under an executor that cannot sleep (several ranks), the idle timer is switched off
    with a warning; the engine loop goes on serving."""
    from pagellm.errors import InvalidRequestError

    llm = AsyncLLM.from_engine_args(EngineArgs(model=folder, **ENGINE), sleep_idle_seconds=0.01)

    def cannot_sleep(level: int = 1) -> None:
        raise InvalidRequestError("sleep is not supported with several ranks (tensor parallelism) yet", "level")

    llm.engine.sleep = cannot_sleep  # type: ignore[method-assign]

    async def scenario() -> list:
        llm.start()
        for _ in range(500):  # the timer fires once the engine has been idle for 0.01 s
            if llm.sleep_idle_seconds is None:
                break
            await asyncio.sleep(0.01)
        outputs = await collect(llm, [5, 6, 7], "after-timer")
        await llm.shutdown()
        return outputs

    outputs = run(scenario())
    assert llm.sleep_idle_seconds is None
    expected = offline.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[-1].outputs[0].token_ids == expected
