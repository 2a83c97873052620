"""The scheduler with LoRA adapters: at most max_loras distinct adapters per step (the
base model takes no slot), no adapter starved by others' new requests, and prefix-cache
keys that carry the adapter."""

from __future__ import annotations

from core_harness import FakeRunner, assert_drained, make_request, step

from pagellm.request import Request


def _adapters_in(loras: dict[str, int], output) -> set[int]:
    return {loras[r] for r in output.num_scheduled_tokens} - {0}


def test_a_step_holds_at_most_max_loras_adapters(new_scheduler):
    scheduler = new_scheduler(max_loras=2)
    runner = FakeRunner(4)
    loras = {f"r{i}": lora for i, lora in enumerate([1, 2, 3, 0, 1, 3, 0])}
    for i, (request_id, lora) in enumerate(loras.items()):
        scheduler.add_request(make_request(request_id, 6, max_tokens=3, lora=lora, arrival_time=float(i)))
    first = step(scheduler, runner).output
    # FCFS: adapters 1 and 2 come first; 3 waits, and the base model's requests pass it,
    # but not adapter 1's later request (it would keep adapter 1 in the slots longer).
    assert _adapters_in(loras, first) == {1, 2}
    assert set(first.num_scheduled_tokens) == {"r0", "r1", "r3", "r6"}
    seen = []
    while scheduler.has_unfinished_requests():
        output = step(scheduler, runner).output
        assert len(_adapters_in(loras, output)) <= 2
        seen.append(output)
    assert any(3 in _adapters_in(loras, o) for o in seen)
    assert_drained(scheduler)


def test_an_adapter_is_not_starved_by_new_requests_of_others(new_scheduler):
    # One slot; adapter 1 keeps receiving requests. Adapter 2's request, older than every
    # later adapter-1 request, runs as soon as the adapter-1 requests before it finish.
    scheduler = new_scheduler(max_loras=1)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("one-0", 6, max_tokens=4, lora=1, arrival_time=0.0))
    scheduler.add_request(make_request("two", 6, max_tokens=4, lora=2, arrival_time=1.0))
    ran_two_at = None
    for i in range(1, 40):
        scheduler.add_request(make_request(f"one-{i}", 6, max_tokens=4, lora=1, arrival_time=1.0 + i))
        output = step(scheduler, runner).output
        if "two" in output.num_scheduled_tokens and ran_two_at is None:
            ran_two_at = i
    assert ran_two_at is not None and ran_two_at <= 6
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_drained(scheduler)


def test_block_keys_carry_the_adapter():
    def keys(lora):
        request = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8], lora=lora)
        return request.get_block_hashes(4)

    base, one, one_again, two = keys(0), keys(1), keys(1), keys(2)
    assert base != one and one != two and base != two
    assert one == one_again


def test_forked_completions_keep_their_adapter(new_scheduler):
    scheduler = new_scheduler(max_loras=1)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("p", 6, max_tokens=3, lora=2, n=3))
    step(scheduler, runner)
    step(scheduler, runner)
    children = [r for r in scheduler.requests.values() if r.parent_request_id == "p"]
    assert len(children) == 2 and all(isinstance(c, Request) and c.lora_int_id == 2 for c in children)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_drained(scheduler)


def test_stats_count_requests_per_adapter(new_scheduler):
    scheduler = new_scheduler(max_loras=1, max_num_seqs=4)
    runner = FakeRunner(4)
    for i, lora in enumerate([1, 1, 2, 0]):
        scheduler.add_request(make_request(f"r{i}", 6, max_tokens=3, lora=lora, arrival_time=float(i)))
    step(scheduler, runner)
    stats = scheduler.make_stats()
    assert stats.running_by_adapter == {"adapter1": 2} and stats.waiting_by_adapter == {"adapter2": 1}
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert scheduler.make_stats().running_by_adapter == {}
    assert_drained(scheduler)
