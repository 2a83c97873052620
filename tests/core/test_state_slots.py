"""A hybrid model's recurrent-state slots in the scheduler: a request is admitted only
with a slot, gives it back when it finishes or is preempted, and a forked completion gets
its own slot filled from its parent's (the fake runner checks every slot's history)."""

import pytest
from core_harness import FakeRunner, assert_drained, make_request, make_scheduler, run_to_completion, step

from pagellm.core.state_slots import StateSlots


def test_admission_waits_for_a_slot_and_finishing_frees_it():
    scheduler = make_scheduler(num_state_slots=2, max_num_seqs=4, num_gpu_blocks=64)
    runner = FakeRunner(4)
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 6, max_tokens=3))
    first = step(scheduler, runner)
    assert set(first.output.num_scheduled_tokens) == {"a", "b"}  # blocks for c, but no slot
    assert sorted(new.state_slot for new in first.output.scheduled_new_reqs) == [0, 1]
    assert scheduler.num_waiting == 1
    results = run_to_completion(scheduler, runner)
    admitted_c = next(r for r in results if any(new.req_id == "c" for new in r.output.scheduled_new_reqs))
    assert [new.state_slot for new in admitted_c.output.scheduled_new_reqs if new.req_id == "c"][0] in (0, 1)
    assert_drained(scheduler)


@pytest.mark.parametrize("host_slots", [None, 0], ids=["host-slots", "no-host-slots"])
def test_swap_preemption_moves_the_state_to_a_host_slot_and_back(host_slots):
    # Too few blocks for both: one is swapped out, its state copied to a host slot with its
    # KV and back into a device slot (the fake runner checks every slot's token history);
    # without host slots for the state, the request is recomputed from zeros instead.
    scheduler = make_scheduler(num_state_slots=2, max_num_seqs=2, num_gpu_blocks=7, num_cpu_blocks=16,
                               preemption_mode="swap", enable_prefix_caching=False, num_host_state_slots=host_slots)  # fmt: skip
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", 8, max_tokens=12))
    scheduler.add_request(make_request("b", 8, max_tokens=12))
    results = run_to_completion(scheduler, runner)
    assert any(r.output.preempted_req_ids for r in results)
    swaps_out = [pair for r in results for pair in r.output.state_swaps.out]
    swaps_in = [pair for r in results for pair in r.output.state_swaps.into]
    stats = scheduler.make_stats()
    if host_slots is None:
        assert swaps_out and len(swaps_in) == len(swaps_out) and stats.num_preemptions_swap == len(swaps_out)
        assert all(r.output.blocks_to_swap_out for r in results if r.output.state_swaps.out)
    else:
        assert not swaps_out and not any(r.output.blocks_to_swap_out for r in results)
        assert stats.num_preemptions_recompute > 0
    assert_drained(scheduler)
    assert scheduler.kv_cache_manager.host_state_slots.num_free == scheduler.kv_cache_manager.host_state_slots.num_slots


def test_a_fork_copies_its_parents_state():
    scheduler = make_scheduler(num_state_slots=3, max_num_seqs=3)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("p", 5, max_tokens=4, n=3))
    results = run_to_completion(scheduler, runner)
    copies = [pair for r in results for pair in r.output.state_copies]
    assert len(copies) == 2 and len({target for _, target in copies}) == 2
    assert_drained(scheduler)


def test_no_prefix_hit_without_the_state_at_its_end():
    prompt = list(range(100, 112))  # three full blocks of 4

    def hit_tokens(num_state_slots: int) -> int:
        scheduler = make_scheduler(num_state_slots=num_state_slots, max_num_seqs=2, enable_prefix_caching=True)
        runner = FakeRunner(4)
        for name in ("first", "second"):
            scheduler.add_request(make_request(name, list(prompt), max_tokens=2))
            run_to_completion(scheduler, runner)
        assert_drained(scheduler)
        return scheduler.kv_cache_manager.stats.num_prefix_hit_tokens

    assert hit_tokens(0) > 0  # the same turn hits on a model whose layers all attend
    assert hit_tokens(2) == 0


def test_slot_pool_integrity():
    slots = StateSlots(3)
    assert slots.allocate("a") == 0 and slots.allocate("b") == 1
    slots.fork("a", "a#1")
    assert slots.take_pending_copies() == [(0, 2)] and slots.num_free == 0
    slots.free("b")
    slots.check_integrity({"a", "a#1"})
    try:
        slots.check_integrity({"a"})
    except AssertionError:
        pass
    else:
        raise AssertionError("a slot held by a request without blocks passed the check")
