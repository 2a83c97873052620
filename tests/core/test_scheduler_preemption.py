"""Scheduler under block pressure: preemption by recompute and swap, victims, resumption.

The common scene: blocks of 4 tokens, 4 usable blocks (1..4). Requests a and b have
7-token prompts and take two blocks each; at the third step a needs a third block.
"""

from __future__ import annotations

import pytest
from core_harness import FakeRunner, assert_drained, make_request, scheduled, step

from pagellm.request import RequestStatus


def free_queue(scheduler) -> list[int]:
    return scheduler.kv_cache_manager.device_pool.free_block_ids()


def start_two(new_scheduler, **kwargs):
    scheduler = new_scheduler(num_gpu_blocks=5, max_model_len=32, **kwargs)
    runner = FakeRunner(4)
    a = make_request("a", 7, max_tokens=6)
    b = make_request("b", 7, max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    r1 = step(scheduler, runner)
    assert {n.req_id: n.block_ids[0] for n in r1.output.scheduled_new_reqs} == {
        "a": [1, 2],
        "b": [3, 4],
    }
    r2 = step(scheduler, runner)
    assert scheduled(r2) == {"a": 1, "b": 1}
    assert free_queue(scheduler) == []
    return scheduler, runner, a, b


def run_until_done(scheduler, runner) -> list:
    results = []
    while scheduler.has_unfinished_requests():
        results.append(step(scheduler, runner))
    return results


def test_recompute_preemption_frees_the_latest_request_and_resumes_it(new_scheduler) -> None:
    scheduler, runner, a, b = start_two(new_scheduler, enable_prefix_caching=False)

    r3 = step(scheduler, runner)
    assert r3.output.preempted_req_ids == {"b"}
    assert scheduled(r3) == {"a": 1}
    # b freed tail first to the head of the queue (3 then 4); a took block 3.
    assert r3.output.scheduled_cached_reqs[0].new_block_ids == [[3]]
    assert free_queue(scheduler) == [4]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [7, 7]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    assert r3.output.blocks_to_swap_out == []

    r4 = step(scheduler, runner)  # b needs 3 blocks for 9 tokens; 1 is free
    assert scheduled(r4) == {"a": 1} and scheduler.num_waiting == 1

    rest = run_until_done(scheduler, runner)
    assert [scheduled(r) for r in rest] == [
        {"a": 1}, {"a": 1}, {"b": 9}, {"b": 1}, {"b": 1}, {"b": 1},
    ]
    resumed = rest[2].output.scheduled_new_reqs[0]
    assert resumed.req_id == "b" and resumed.num_computed_tokens == 0
    assert resumed.output_token_ids == [7, 7]  # recomputes prompt and outputs
    assert resumed.block_ids == [[1, 2, 3]]
    assert rest[2].output.finished_req_ids == {"a"}
    assert a.output_token_ids == b.output_token_ids == [7] * 6
    stats = scheduler.make_stats()
    assert (stats.num_preemptions_recompute, stats.num_preemptions_swap) == (1, 0)
    assert_drained(scheduler)


def test_recompute_resumption_hits_its_own_cached_blocks(new_scheduler) -> None:
    scheduler, runner, a, b = start_two(new_scheduler, enable_prefix_caching=True)

    r3 = step(scheduler, runner)
    assert r3.output.preempted_req_ids == {"b"}
    # b's two full blocks are cached: queued tail first at the LRU end, so block 4 (the
    # chain's tail) is evicted by a's allocation and block 3 stays hit-able.
    assert r3.output.scheduled_cached_reqs[0].new_block_ids == [[4]]
    assert free_queue(scheduler) == [3]

    rest = run_until_done(scheduler, runner)
    assert [scheduled(r) for r in rest] == [
        {"a": 1}, {"a": 1}, {"a": 1}, {"b": 5}, {"b": 1}, {"b": 1}, {"b": 1},
    ]
    resumed = rest[3].output.scheduled_new_reqs[0]
    # Hit block 3; then a's freed cached blocks are evicted tail first: 4, then 2.
    assert resumed.block_ids == [[3, 4, 2]]
    assert resumed.num_computed_tokens == 4
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert scheduler.make_stats().num_prefix_hit_tokens == 4
    assert_drained(scheduler)


def test_swap_preemption_copies_blocks_out_and_back_in(new_scheduler) -> None:
    scheduler, runner, a, b = start_two(
        new_scheduler, enable_prefix_caching=False, num_cpu_blocks=4, preemption_mode="swap"
    )
    r3 = step(scheduler, runner)
    assert r3.output.preempted_req_ids == {"b"}
    assert r3.output.blocks_to_swap_out == [(3, 0), (4, 1)]
    assert r3.output.scheduled_cached_reqs[0].new_block_ids == [[3]]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 8
    assert scheduler.kv_cache_manager.get_host_block_ids("b") == [0, 1]
    assert scheduler.num_swapped == 1

    rest = run_until_done(scheduler, runner)
    assert [scheduled(r) for r in rest] == [
        {"a": 1}, {"a": 1}, {"a": 1}, {"b": 1}, {"b": 1}, {"b": 1}, {"b": 1},
    ]
    swap_step = rest[3].output
    assert swap_step.blocks_to_swap_in == [(0, 1), (1, 2)]
    assert swap_step.blocks_to_swap_out == []
    resumed = swap_step.scheduled_new_reqs[0]
    assert (resumed.req_id, resumed.num_computed_tokens) == ("b", 8)
    assert resumed.block_ids == [[1, 2, 3]]
    assert resumed.output_token_ids == [7, 7]
    assert b.output_token_ids == [7] * 6
    stats = scheduler.make_stats()
    assert (stats.num_preemptions_recompute, stats.num_preemptions_swap) == (0, 1)
    assert stats.num_swapped_out_blocks == stats.num_swapped_in_blocks == 2
    assert_drained(scheduler)


def test_swap_falls_back_to_recompute_when_the_host_is_full(new_scheduler) -> None:
    scheduler, runner, a, b = start_two(
        new_scheduler, enable_prefix_caching=False, num_cpu_blocks=1, preemption_mode="swap"
    )
    r3 = step(scheduler, runner)
    assert r3.output.preempted_req_ids == {"b"}
    assert r3.output.blocks_to_swap_out == []
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    stats = scheduler.make_stats()
    assert (stats.num_preemptions_recompute, stats.num_preemptions_swap) == (1, 0)
    run_until_done(scheduler, runner)
    assert_drained(scheduler)


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_latest(new_scheduler) -> None:
    scheduler = new_scheduler(num_gpu_blocks=5, max_model_len=32)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    scheduler.add_request(make_request("b", 12, max_tokens=4))
    r1 = step(scheduler, runner)
    assert scheduled(r1) == {"a": 3, "b": 12}
    r2 = step(scheduler, runner)  # a fits its block; b needs a 4th, the victim is b
    assert scheduled(r2) == {"a": 1} and r2.output.preempted_req_ids == {"b"}
    r3 = step(scheduler, runner)
    # Its three full blocks were cached when computed: only the last token is recomputed.
    assert scheduled(r3) == {"b": 1}
    assert r3.output.scheduled_new_reqs[0].num_computed_tokens == 12
    run_until_done(scheduler, runner)
    assert_drained(scheduler)


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_priority_preempts_the_lowest_priority_even_if_already_scheduled(
    new_scheduler, policy, victim
) -> None:
    scheduler = new_scheduler(num_gpu_blocks=5, max_model_len=32, scheduling_policy=policy)
    runner = FakeRunner(4)
    low = make_request("low", 4, max_tokens=4, priority=5)
    high = make_request("high", 7, max_tokens=3, priority=0)
    scheduler.add_request(low)
    assert scheduled(step(scheduler, runner)) == {"low": 4}
    scheduler.add_request(high)
    assert scheduled(step(scheduler, runner)) == {"low": 1, "high": 7}
    assert scheduled(step(scheduler, runner)) == {"low": 1, "high": 1}
    assert free_queue(scheduler) == []

    r4 = step(scheduler, runner)  # high needs a 3rd block
    assert r4.output.preempted_req_ids == {victim}
    if policy == "priority":
        # low had been scheduled this step: its tokens are given back to the budget.
        assert scheduled(r4) == {"high": 1}
        assert r4.output.total_num_scheduled_tokens == 1
        assert [c.new_block_ids[0] for c in r4.output.scheduled_cached_reqs] == [[2]]
        assert low.num_computed_tokens == 0 and low.status is RequestStatus.WAITING
    else:
        assert scheduled(r4) == {"low": 1}
    run_until_done(scheduler, runner)
    assert low.num_output_tokens == 4 and high.num_output_tokens == 3
    assert_drained(scheduler)


def test_no_admission_in_a_step_that_preempted(new_scheduler) -> None:
    scheduler, runner, a, b = start_two(new_scheduler, enable_prefix_caching=False)
    scheduler.add_request(make_request("tiny", 1, max_tokens=1))
    r3 = step(scheduler, runner)
    assert r3.output.preempted_req_ids == {"b"}
    assert scheduled(r3) == {"a": 1}  # one block is free, but tiny waits
    r4 = step(scheduler, runner)
    # b (preempted, at the head) cannot fit; tiny must not overtake it.
    assert scheduled(r4) == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b", "tiny"]
    run_until_done(scheduler, runner)
    assert_drained(scheduler)


def test_a_background_victim_scheduled_this_step_is_recomputed_not_swapped() -> None:
    """A forked background completion given copy-on-write blocks earlier in the step, then
    chosen as the victim (background work goes first): its new blocks are only filled by
    the step's copies, which the runner makes after the swap-outs, so swapping it out
    would save blocks not written yet (found by the property test)."""
    from core_harness import make_scheduler, run_to_completion

    scheduler = make_scheduler(
        block_size=2, num_gpu_blocks=10, num_cpu_blocks=3, enable_prefix_caching=False, max_num_seqs=4,
        max_num_batched_tokens=4, max_model_len=4, enable_chunked_prefill=False, preemption_mode="swap",
        group_windows=(None, 1, 1),
    )  # fmt: skip
    runner = FakeRunner(2, group_windows=(None, 1, 1))  # it checks every position read
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", [10], max_tokens=1))
    scheduler.add_request(make_request("background", [10], max_tokens=2, n=2, background=True))
    step(scheduler, runner)
    step(scheduler, runner)  # the background request runs and forks
    scheduler.add_request(make_request("late", [10], max_tokens=2, n=2))
    results = run_to_completion(scheduler, runner)
    preempted = [r.output for r in results if "background#1" in r.output.preempted_req_ids]
    assert preempted and not preempted[0].blocks_to_swap_out, "preempted by recompute"
    assert_drained(scheduler)
