"""finish_requests (abort, or a stop string seen outside) in every state of a request."""

from __future__ import annotations

import pytest
from core_harness import FakeRunner, assert_drained, make_request, scheduled, step

from pagellm.request import FinishReason, RequestStatus

ABORTED = RequestStatus.FINISHED_ABORTED


def device_free(scheduler) -> int:
    return scheduler.kv_cache_manager.num_free_blocks


def test_abort_waiting(new_scheduler) -> None:
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    request = make_request("a", 5)
    scheduler.add_request(request)
    scheduler.finish_requests("a", ABORTED)
    assert request.status is ABORTED and request.finish_reason is FinishReason.ABORT
    result = step(scheduler, runner)
    assert result.output.finished_req_ids == {"a"} and scheduled(result) == {}
    assert_drained(scheduler)


def test_abort_running_mid_prefill(new_scheduler) -> None:
    scheduler = new_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 2, max_tokens=2))
    assert scheduled(step(scheduler, runner)) == {"a": 4}
    assert scheduler.kv_cache_manager.get_block_ids("a") == [1]
    scheduler.finish_requests(["a"], ABORTED)
    assert not scheduler.kv_cache_manager.holds_blocks("a")
    result = step(scheduler, runner)
    assert result.output.finished_req_ids == {"a"}
    assert scheduled(result) == {"b": 2}
    assert "a" not in runner.requests  # the runner dropped its state
    step(scheduler, runner)
    assert_drained(scheduler)


def test_abort_running_decode(new_scheduler) -> None:
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    request = make_request("a", 5, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler, runner)
    step(scheduler, runner)
    assert request.output_token_ids == [7, 7]
    scheduler.finish_requests("a", ABORTED)
    assert step(scheduler, runner).output.finished_req_ids == {"a"}
    assert_drained(scheduler)


def test_finish_from_outside_with_stopped_status(new_scheduler) -> None:
    """E.g. the output processor matched a stop string."""
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    request = make_request("a", 5, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler, runner)
    scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert request.finish_reason is FinishReason.STOP
    assert step(scheduler, runner).output.finished_req_ids == {"a"}
    assert_drained(scheduler)


def preempt_b(new_scheduler, **kwargs):
    """a and b fill the 4 blocks; at the third step b is preempted."""
    scheduler = new_scheduler(num_gpu_blocks=5, max_model_len=32, **kwargs)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 7, max_tokens=6))
    scheduler.add_request(make_request("b", 7, max_tokens=6))
    for _ in range(3):
        result = step(scheduler, runner)
    assert result.output.preempted_req_ids == {"b"}
    return scheduler, runner


def test_abort_preempted_by_recompute(new_scheduler) -> None:
    scheduler, runner = preempt_b(new_scheduler)
    assert scheduler.requests["b"].status is RequestStatus.WAITING
    free_before = device_free(scheduler)
    scheduler.finish_requests("b", ABORTED)
    assert device_free(scheduler) == free_before  # it held nothing
    result = step(scheduler, runner)
    assert result.output.finished_req_ids == {"b"} and scheduled(result) == {"a": 1}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_drained(scheduler)


def test_abort_swapped(new_scheduler) -> None:
    scheduler, runner = preempt_b(new_scheduler, num_cpu_blocks=4, preemption_mode="swap")
    kv = scheduler.kv_cache_manager
    assert scheduler.requests["b"].status is RequestStatus.SWAPPED
    assert kv.host_pool.num_free_blocks == 2
    scheduler.finish_requests("b", ABORTED)
    assert kv.host_pool.num_free_blocks == 4 and scheduler.num_swapped == 0
    assert step(scheduler, runner).output.finished_req_ids == {"b"}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_drained(scheduler)


def test_abort_between_schedule_and_update(new_scheduler) -> None:
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5, max_tokens=1))
    out = scheduler.schedule()
    runner_output = runner.execute(out)
    scheduler.finish_requests("a", ABORTED)
    progress = scheduler.update_from_output(out, runner_output)
    assert [p.req_id for p in progress] == ["b"]  # a's sample is dropped
    scheduler.check_integrity()
    assert scheduler.schedule().finished_req_ids == {"a", "b"}
    assert_drained(scheduler)


def test_finish_requests_ignores_unknown_ids_and_needs_a_finished_status(
    new_scheduler,
) -> None:
    scheduler = new_scheduler()
    scheduler.finish_requests(["nope"], ABORTED)
    assert scheduler.schedule().finished_req_ids == set()
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("nope", RequestStatus.RUNNING)
