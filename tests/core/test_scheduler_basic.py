"""Scheduler: admission order, chunked prefill and budget, stops, refusals at add time."""

from __future__ import annotations

import pytest
from core_harness import (
    FakeRunner,
    assert_drained,
    make_request,
    run_to_completion,
    scheduled,
    step,
)

from pagellm.errors import InvalidRequestError
from pagellm.request import FinishReason, RequestStatus


def admitted(result) -> list[str]:
    return [new.req_id for new in result.output.scheduled_new_reqs]


def test_fcfs_admits_in_arrival_order_up_to_max_num_seqs(new_scheduler) -> None:
    scheduler = new_scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 3, max_tokens=2, priority=9))
    scheduler.add_request(make_request("b", 3, max_tokens=3))
    scheduler.add_request(make_request("c", 3, max_tokens=1, priority=-9))

    r1 = step(scheduler, runner)
    assert admitted(r1) == ["a", "b"] and scheduled(r1) == {"a": 3, "b": 3}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    r2 = step(scheduler, runner)
    assert scheduled(r2) == {"a": 1, "b": 1}
    assert [p.req_id for p in r2.progress if p.finished] == ["a"]
    r3 = step(scheduler, runner)
    assert r3.output.finished_req_ids == {"a"}
    assert admitted(r3) == ["c"] and scheduled(r3) == {"b": 1, "c": 3}
    assert {p.req_id for p in r3.progress if p.finished} == {"b", "c"}
    assert_drained(scheduler)


def test_priority_admits_lowest_value_first_then_earliest_arrival(new_scheduler) -> None:
    scheduler = new_scheduler(max_num_seqs=1, scheduling_policy="priority")
    runner = FakeRunner(4)
    for request_id, priority, arrival in [
        ("a", 2, 0.0),
        ("b", 0, 1.0),
        ("c", 1, 2.0),
        ("d", 0, 3.0),
        ("e", 0, 0.5),  # added late but arrived early
        ("f", 0, 3.0),  # same key as d: the one added first wins
    ]:
        scheduler.add_request(
            make_request(request_id, 3, max_tokens=1, priority=priority, arrival_time=arrival)
        )
    order = [admitted(result) for result in run_to_completion(scheduler, runner)]
    assert order == [["e"], ["b"], ["d"], ["f"], ["c"], ["a"]]


def test_chunked_prefill_splits_a_prompt_by_the_token_budget(new_scheduler) -> None:
    scheduler = new_scheduler(max_num_batched_tokens=7)
    runner = FakeRunner(4)
    request = make_request("a", 20, max_tokens=3)
    scheduler.add_request(request)
    results = run_to_completion(scheduler, runner)
    assert [scheduled(r) for r in results] == [{"a": 7}, {"a": 7}, {"a": 6}, {"a": 1}, {"a": 1}]
    assert results[0].output.scheduled_new_reqs[0].block_ids == [[1, 2]]
    new_blocks = [
        [c.new_block_ids[0] for c in r.output.scheduled_cached_reqs] for r in results[1:]
    ]
    assert new_blocks == [[[3, 4]], [[5]], [[6]], [[]]]
    # Nothing is sampled for a partial chunk.
    assert [len(r.progress) for r in results] == [0, 0, 1, 1, 1]
    assert request.output_token_ids == [7, 7, 7]
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_chunked_prefill_shares_the_budget_with_decodes(new_scheduler) -> None:
    scheduler = new_scheduler(max_num_batched_tokens=7)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("b", 3, max_tokens=6))
    scheduler.add_request(make_request("a", 20, max_tokens=2))
    results = run_to_completion(scheduler, runner)
    assert [scheduled(r) for r in results] == [
        {"b": 3, "a": 4},
        {"b": 1, "a": 6},
        {"b": 1, "a": 6},
        {"b": 1, "a": 4},
        {"b": 1, "a": 1},
        {"b": 1},
    ]
    assert [r.output.total_num_scheduled_tokens for r in results] == [7, 7, 7, 5, 2, 1]
    first = {new.req_id: new.block_ids[0] for new in results[0].output.scheduled_new_reqs}
    assert first == {"b": [1], "a": [2]}
    blocks = [
        {c.req_id: c.new_block_ids[0] for c in r.output.scheduled_cached_reqs} for r in results[1:]
    ]
    assert blocks == [
        {"b": [], "a": [3, 4]},
        {"b": [5], "a": [6]},
        {"b": [], "a": [7]},
        {"b": [], "a": [8]},
        {"b": []},
    ]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(new_scheduler) -> None:
    scheduler = new_scheduler(
        max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=False
    )
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 20, max_tokens=3))
    scheduler.add_request(make_request("b", 20, max_tokens=2))
    scheduler.add_request(make_request("c", 5, max_tokens=1))
    results = run_to_completion(scheduler, runner)
    # c would fit beside a, but must not overtake b.
    assert [scheduled(r) for r in results] == [
        {"a": 20},
        {"a": 1, "b": 20, "c": 5},
        {"a": 1, "b": 1},
    ]


def sequence_sampler(tokens: list[int]):
    def sample(request_id: str, so_far: list[int]) -> int:
        return tokens.pop(0)

    return sample


@pytest.mark.parametrize(
    "params, sampled, outputs, reason, stop_reason",
    [
        (dict(stop_token_ids=[9]), [5, 9, 5], [5, 9], FinishReason.STOP, 9),
        (dict(), [5, 2, 5], [5, 2], FinishReason.STOP, None),  # EOS
        (dict(ignore_eos=True, max_tokens=3), [2, 2, 2, 2], [2, 2, 2], FinishReason.LENGTH, None),
        (dict(min_tokens=2), [2, 2, 5], [2, 2], FinishReason.STOP, None),
        (dict(min_tokens=3, stop_token_ids=[9]), [9, 9, 9, 9], [9, 9, 9], FinishReason.STOP, 9),
        (dict(max_tokens=2, stop_token_ids=[9]), [5, 9], [5, 9], FinishReason.STOP, 9),
        (dict(max_tokens=2), [5, 6, 7], [5, 6], FinishReason.LENGTH, None),
        (dict(max_tokens=None), [5] * 10, [5] * 6, FinishReason.LENGTH, None),  # max_model_len
    ],
)
def test_stop_conditions(new_scheduler, params, sampled, outputs, reason, stop_reason) -> None:
    scheduler = new_scheduler(max_model_len=16)
    runner = FakeRunner(4, sample=sequence_sampler(list(sampled)))
    request = make_request("r", 10, eos_token_ids=(2,), **{"max_tokens": 5, **params})
    scheduler.add_request(request)
    results = run_to_completion(scheduler, runner)
    progress = [p for r in results for p in r.progress]
    assert [t for p in progress for t in p.new_token_ids] == outputs
    assert request.output_token_ids == outputs
    assert [p.finish_reason for p in progress] == [None] * (len(outputs) - 1) + [reason]
    assert progress[-1].stop_reason == stop_reason == request.stop_reason
    assert request.finish_reason is reason


def test_max_tokens_none_resolves_to_max_model_len(new_scheduler) -> None:
    scheduler = new_scheduler(max_model_len=16)
    request = make_request("r", 10, max_tokens=None)
    scheduler.add_request(request)
    assert request.max_tokens == 6
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize(
    "prompt, max_tokens, parameter, fragments",
    [
        (0, 4, "prompt", ["empty"]),
        (64, 4, "prompt", ["64 tokens", "maximum context length is 64"]),
        (70, None, "prompt", ["70 tokens"]),
        (10, 60, "max_tokens", ["70 were requested", "10 in the prompt", "60", "at most 54"]),
        (10, 0, "max_tokens", ["at least 1"]),
    ],
)
def test_requests_longer_than_the_model_are_refused(
    new_scheduler, prompt, max_tokens, parameter, fragments
) -> None:
    scheduler = new_scheduler(max_model_len=64)
    request = make_request("r", prompt)
    request.max_tokens = max_tokens
    with pytest.raises(InvalidRequestError) as info:
        scheduler.add_request(request)
    assert info.value.parameter == parameter
    for fragment in fragments:
        assert fragment in str(info.value)
    assert not scheduler.has_unfinished_requests()


def test_requests_larger_than_the_cache_are_refused(new_scheduler) -> None:
    # 4 usable blocks of 4 tokens: 16 tokens of KV in all.
    scheduler = new_scheduler(num_gpu_blocks=5, max_model_len=64)
    with pytest.raises(InvalidRequestError) as info:
        scheduler.add_request(make_request("long", 17, max_tokens=1))
    assert info.value.parameter == "prompt"
    assert "needs 5 KV cache blocks" in str(info.value)
    assert "holds 4 blocks of 4 tokens (16 tokens)" in str(info.value)

    with pytest.raises(InvalidRequestError) as info:
        scheduler.add_request(make_request("greedy", 10, max_tokens=8))
    assert info.value.parameter == "max_tokens"
    assert "may need 5 KV cache blocks" in str(info.value)
    assert "at most 7" in str(info.value)
    assert not scheduler.has_unfinished_requests()

    # The largest request that fits is served, alone in the cache.
    request = make_request("fits", 10, max_tokens=7)
    scheduler.add_request(request)
    run_to_completion(scheduler, FakeRunner(4))
    assert request.num_output_tokens == 7


def test_duplicate_request_ids_are_refused(new_scheduler) -> None:
    scheduler = new_scheduler()
    scheduler.add_request(make_request("r", 3))
    with pytest.raises(InvalidRequestError) as info:
        scheduler.add_request(make_request("r", 3))
    assert info.value.parameter == "request_id"
    run_to_completion(scheduler, FakeRunner(4))
    scheduler.add_request(make_request("r", 3))  # reusable once finished
    run_to_completion(scheduler, FakeRunner(4))


@pytest.mark.parametrize(
    "preemption_mode, num_cpu_blocks, policy",
    [
        ("recompute", 0, "fcfs"),
        ("recompute", 0, "priority"),
        ("swap", 16, "fcfs"),
        ("swap", 16, "priority"),
        ("swap", 2, "fcfs"),  # host too small for most: falls back to recompute
    ],
)
def test_a_tiny_pool_serves_many_requests(
    new_scheduler, preemption_mode, num_cpu_blocks, policy
) -> None:
    scheduler = new_scheduler(
        num_gpu_blocks=5,
        num_cpu_blocks=num_cpu_blocks,
        max_model_len=32,
        max_num_batched_tokens=8,
        preemption_mode=preemption_mode,
        scheduling_policy=policy,
    )
    runner = FakeRunner(4, sample=lambda rid, tokens: len(tokens))
    requests = [
        make_request(f"r{i}", 6, max_tokens=8, priority=i % 3) for i in range(20)
    ]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    for request in requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        # The fake sampler returns the position: any lost or repeated token shows.
        assert request.output_token_ids == list(range(6, 14))
    stats = scheduler.make_stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    if preemption_mode == "swap" and num_cpu_blocks == 16:
        assert stats.num_preemptions_swap > 0
        assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks > 0


def test_n_beyond_max_num_seqs_is_refused_when_added() -> None:
    """The completions of one request run side by side: with more of them than
    max_num_seqs it could never be admitted, so it is refused rather than left waiting."""
    import pytest
    from core_harness import make_request, make_scheduler

    from pagellm.errors import InvalidRequestError

    scheduler = make_scheduler(max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="max_num_seqs") as refused:
        scheduler.add_request(make_request("r", 3, n=3))
    assert refused.value.parameter == "n"
    scheduler.add_request(make_request("ok", 3, n=2))
