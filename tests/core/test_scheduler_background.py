"""Background requests (batch lines): served only where interactive requests leave room,
preempted first, and an interactive request that arrives never waits for them: its first
token comes after as many steps as on an idle scheduler. Under every policy and both
preemption modes, with the fake runner checking the KV content."""

from __future__ import annotations

import pytest
from core_harness import FakeRunner, assert_drained, make_request, step

from pagellm.request import RequestStatus

POLICIES = ["fcfs", "priority", "shortest-remaining"]


def steps_to_first_token(scheduler, runner, request_id: str) -> tuple[int, list]:  # noqa: ANN001
    """Steps until `request_id` has a token; the results of every step."""
    results = []
    while True:
        result = step(scheduler, runner)
        results.append(result)
        request = scheduler.requests.get(request_id)
        if request is None or request.output_token_ids:
            return len(results), results


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_interactive_request_does_not_wait_for_background_work(new_scheduler, policy, mode):
    # Idle: the interactive request alone.
    idle = new_scheduler(num_gpu_blocks=33, num_cpu_blocks=32, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=64, scheduling_policy=policy, preemption_mode=mode)  # fmt: skip
    idle.add_request(make_request("chat", 20, max_tokens=3))
    idle_runner = FakeRunner(4)
    idle_steps, _ = steps_to_first_token(idle, idle_runner, "chat")
    while idle.has_unfinished_requests():
        step(idle, idle_runner)

    scheduler = new_scheduler(num_gpu_blocks=33, num_cpu_blocks=32, max_num_seqs=4, max_num_batched_tokens=16,
                              max_model_len=64, scheduling_policy=policy, preemption_mode=mode)  # fmt: skip
    runner = FakeRunner(4)
    lines = [make_request(f"line{i}", 12, max_tokens=8, background=True) for i in range(8)]
    for line in lines:
        scheduler.add_request(line)
    for _ in range(6):  # the batch fills the seats and the blocks
        step(scheduler, runner)
    assert len(scheduler.running) == 4 and all(r.background for r in scheduler.running)
    scheduler.add_request(make_request("chat", 20, max_tokens=3))
    busy_steps, results = steps_to_first_token(scheduler, runner, "chat")
    assert busy_steps <= idle_steps  # within 1.2x of idle: here, no slower at all
    preempted = set().union(*(r.output.preempted_req_ids for r in results))
    assert preempted and preempted <= {line.request_id for line in lines}  # only background work yields
    while scheduler.has_unfinished_requests():  # the batch finishes once traffic stops
        step(scheduler, runner)
    assert all(line.status is RequestStatus.FINISHED_LENGTH for line in lines)
    assert_drained(scheduler)


@pytest.mark.parametrize("policy", POLICIES)
def test_background_work_waits_behind_every_interactive_request(new_scheduler, policy):
    scheduler = new_scheduler(max_num_seqs=2, scheduling_policy=policy)
    runner = FakeRunner(4)
    # The batch line arrived first and has the best priority value, and still goes last.
    scheduler.add_request(make_request("line", 8, max_tokens=2, background=True, priority=-10, arrival_time=0.0))
    scheduler.add_request(make_request("a", 8, max_tokens=2, priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("b", 8, max_tokens=2, priority=5, arrival_time=2.0))
    first = step(scheduler, runner)
    assert {n.req_id for n in first.output.scheduled_new_reqs} == {"a", "b"}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_drained(scheduler)


def test_under_block_pressure_background_work_is_the_victim(new_scheduler):
    # Interactive "a" needs a third block; background "line" holds the others.
    scheduler = new_scheduler(num_gpu_blocks=5, max_model_len=32)
    runner = FakeRunner(4)
    line = make_request("line", 7, max_tokens=6, background=True)
    a = make_request("a", 7, max_tokens=6)
    scheduler.add_request(a)
    scheduler.add_request(line)
    step(scheduler, runner)
    step(scheduler, runner)
    result = step(scheduler, runner)  # "a" (admitted first) needs its third block
    assert result.output.preempted_req_ids == {"line"}
    assert a.status is RequestStatus.RUNNING
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_drained(scheduler)


def test_background_requests_are_not_counted_against_the_queue_limit(new_scheduler):
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    for i in range(3):
        scheduler.add_request(make_request(f"line{i}", 8, background=True))
    scheduler.add_request(make_request("a", 8))
    assert scheduler.num_waiting == 4 and scheduler.num_waiting_interactive == 1
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)


def test_background_work_sits_out_an_interactive_prefill(new_scheduler):
    scheduler = new_scheduler(max_num_batched_tokens=8, max_model_len=64)
    runner = FakeRunner(4)
    lines = [make_request(f"line{i}", 4, max_tokens=30, background=True) for i in range(2)]
    for line in lines:
        scheduler.add_request(line)
    step(scheduler, runner)
    assert {r.request_id for r in scheduler.running} == {"line0", "line1"}
    scheduler.add_request(make_request("chat", 20, max_tokens=2))
    chunks = []
    while not scheduler.requests["chat"].output_token_ids:
        result = step(scheduler, runner)
        chunks.append(result.output.num_scheduled_tokens)
    # The chat's 20 prompt tokens go in chunks of the whole budget, with no line beside them.
    assert chunks == [{"chat": 8}, {"chat": 8}, {"chat": 4}]
    # Then the lines decode beside it again.
    assert set(step(scheduler, runner).output.num_scheduled_tokens) == {"chat", "line0", "line1"}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_drained(scheduler)


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_background_work_takes_at_most_its_token_budget_per_step(new_scheduler, budget):
    scheduler = new_scheduler(max_num_batched_tokens=32, max_model_len=64, background_token_budget=budget)
    runner = FakeRunner(4)
    lines = [make_request(f"line{i}", 9, max_tokens=5, background=True) for i in range(4)]
    for line in lines:
        scheduler.add_request(line)
    steps = 0
    while scheduler.has_unfinished_requests():
        result = step(scheduler, runner)
        assert 0 < result.output.total_num_scheduled_tokens <= budget  # never stalls, never more
        steps += 1
        if steps == 2:  # an interactive request still gets the whole step budget
            scheduler.add_request(make_request("chat", 20, max_tokens=1))
            assert step(scheduler, runner).output.num_scheduled_tokens == {"chat": 20}
    assert all(line.status is RequestStatus.FINISHED_LENGTH for line in lines)
    assert_drained(scheduler)
