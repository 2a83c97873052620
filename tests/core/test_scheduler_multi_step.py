"""Scheduler: multi-step decoding (--num-scheduler-steps): when decodes get several
positions per step, how many, and what a stop in the middle of a run leaves."""

from __future__ import annotations

from core_harness import FakeRunner, assert_drained, make_request, make_scheduler, run_to_completion, scheduled, step

from pagellm.request import FinishReason
from pagellm.structured_outputs_params import StructuredOutputsParams


def counting_sampler(request_id: str, tokens: list[int]) -> int:
    return 100 + len(tokens)  # a token that tells its position


def test_decodes_take_n_positions_once_nothing_waits() -> None:
    scheduler = make_scheduler(num_scheduler_steps=4, max_model_len=64)
    runner = FakeRunner(4, sample=counting_sampler)
    scheduler.add_request(make_request("a", 5, max_tokens=20))
    scheduler.add_request(make_request("b", 3, max_tokens=20))
    first = step(scheduler, runner)  # the prefills: one token each
    assert scheduled(first) == {"a": 5, "b": 3} and not first.output.decode_steps
    second = step(scheduler, runner)
    assert scheduled(second) == {"a": 4, "b": 4} and second.output.decode_steps == {"a": 4, "b": 4}
    tokens = {p.req_id: p.new_token_ids for p in second.progress}
    # Each sampled after the one before it: positions 6..9 of a, 4..7 of b.
    assert tokens == {"a": [106, 107, 108, 109], "b": [104, 105, 106, 107]}
    run_to_completion(scheduler, runner)
    assert_drained(scheduler)


def test_a_waiting_request_keeps_steps_single() -> None:
    scheduler = make_scheduler(num_scheduler_steps=4, max_num_seqs=1)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 5, max_tokens=10))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", 3, max_tokens=10))  # no seat: it waits
    result = step(scheduler, runner)
    assert scheduled(result) == {"a": 1} and not result.output.decode_steps


def test_steps_stop_at_max_tokens_and_max_model_len() -> None:
    scheduler = make_scheduler(num_scheduler_steps=8, max_model_len=16)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("short", 2, max_tokens=4))  # 3 tokens left after the first
    scheduler.add_request(make_request("long", 10, max_tokens=None))  # the context ends at 16
    step(scheduler, runner)
    result = step(scheduler, runner)
    assert result.output.decode_steps == {"short": 3, "long": 5}
    finished = {p.req_id: p.finish_reason for p in result.progress if p.finished}
    assert finished == {"short": FinishReason.LENGTH, "long": FinishReason.LENGTH}
    assert scheduler.requests == {} or all(r.is_finished for r in scheduler.requests.values())
    assert_drained(scheduler)


def test_a_stop_inside_a_run_keeps_the_tokens_before_it() -> None:
    scheduler = make_scheduler(num_scheduler_steps=4)
    runner = FakeRunner(4, sample=counting_sampler)
    # Prompt of 3: the first output is 103, then 104, 105 (EOS) and 106 would follow.
    scheduler.add_request(make_request("a", 3, max_tokens=20, eos_token_ids=(105,)))
    step(scheduler, runner)
    result = step(scheduler, runner)
    assert result.output.decode_steps == {"a": 4}
    (progress,) = result.progress
    assert progress.new_token_ids == [104, 105] and progress.finish_reason == FinishReason.STOP
    assert_drained(scheduler)


def test_no_room_for_the_lookahead_means_one_position_not_a_preemption() -> None:
    # 4 usable blocks of 4. After the prefills "a" (7 + 1 tokens) holds 2 and "b" (3 + 1)
    # holds 1: a run of 4 positions takes the last free block for "a"; "b" would need
    # another for its run, so it decodes one position (in its own block), and nobody is
    # preempted for a look-ahead.
    scheduler = make_scheduler(num_scheduler_steps=4, num_gpu_blocks=5, max_model_len=16)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 7, max_tokens=8))
    scheduler.add_request(make_request("b", 3, max_tokens=8))
    step(scheduler, runner)
    result = step(scheduler, runner)
    assert scheduled(result) == {"a": 4, "b": 1} and result.output.decode_steps == {"a": 4}
    assert not result.output.preempted_req_ids
    run_to_completion(scheduler, runner)
    assert_drained(scheduler)


def test_a_grammar_in_the_batch_keeps_every_step_single() -> None:
    scheduler = make_scheduler(num_scheduler_steps=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("plain", 3, max_tokens=8))
    scheduler.add_request(
        make_request("json", 3, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    )
    results = run_to_completion(scheduler, runner)
    assert all(not r.output.decode_steps for r in results)
    assert_drained(scheduler)
