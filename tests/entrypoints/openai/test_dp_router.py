"""The data-parallel routing policy (pure Python): prefix affinity first, load second,
a bound against hot prefixes, dead replicas skipped."""

import pytest

from pagellm.entrypoints.openai.data_parallel.router import PrefixAffinityRouter, block_chain_hashes

BLOCK = 4


def prompt(prefix_id: int, shared_blocks: int, tail: list[int]) -> list[int]:
    return [1000 * prefix_id + i for i in range(shared_blocks * BLOCK)] + tail


def test_block_hashes_chain_over_whole_prefixes():
    a = block_chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    b = block_chain_hashes([1, 2, 3, 4, 5, 6, 7, 9], BLOCK)
    c = block_chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # a partial last block has no hash
    assert c[1] != a[1]  # the same second block after a different first one is another prefix
    assert len(block_chain_hashes(list(range(1000)), BLOCK, max_blocks=5)) == 5


def test_new_prefixes_take_turns_and_shared_ones_stick():
    router = PrefixAffinityRouter(2, block_size=BLOCK)
    first = router.choose(prompt(1, 3, [7]))
    second = router.choose(prompt(2, 3, [7]))
    assert (first.reason, second.reason) == ("load", "load") and first.replica != second.replica
    again = router.choose(prompt(1, 3, [8, 9]))
    assert again.reason == "affinity" and again.replica == first.replica and again.matched_blocks == 3
    partial = router.choose(prompt(2, 2, [5, 5, 5, 5]))  # shares 2 of prefix 2's blocks
    assert partial.replica == second.replica and partial.matched_blocks == 2


def test_affinity_yields_to_load_past_the_bound():
    router = PrefixAffinityRouter(2, block_size=BLOCK, balance_abs=2, balance_rel=1.5)
    hot = prompt(1, 4, [])
    replicas = []
    for _ in range(12):  # a flood of one prefix, none finishing
        decision = router.choose(hot)
        router.started(decision.replica)
        replicas.append(decision)
    counts = [sum(d.replica == r for d in replicas) for r in range(2)]
    assert min(counts) >= 4, counts  # spread, not piled onto one
    assert any(d.reason == "balance" for d in replicas)
    # Once both hold the prefix, affinity picks the less loaded of the two.
    router.loads[0].in_flight, router.loads[1].in_flight = 3, 0
    decision = router.choose(hot)
    assert decision.reason == "affinity" and decision.replica == 1
    router.loads[0].in_flight, router.loads[1].in_flight = 0, 3
    decision = router.choose(hot)
    assert decision.reason == "affinity" and decision.replica == 0


def test_dead_replicas_are_skipped_and_forgotten():
    router = PrefixAffinityRouter(3, block_size=BLOCK)
    p = prompt(1, 2, [])
    holder = router.choose(p).replica
    router.mark_dead(holder)
    decision = router.choose(p)
    assert decision.replica != holder and decision.reason == "load"
    assert router.num_alive == 2
    for r in range(3):
        router.mark_dead(r)
    with pytest.raises(LookupError):
        router.choose(p)


def test_finished_requests_lower_the_load_and_kv_usage_breaks_ties():
    router = PrefixAffinityRouter(2, block_size=BLOCK)
    router.started(0)
    router.finished(0)
    router.finished(0)  # never below zero
    assert router.loads[0].in_flight == 0
    router.report_kv_usage(0, 0.9)
    router.report_kv_usage(1, 0.1)
    assert router.choose([1, 2, 3]).replica == 1  # no full block: by load alone


def test_without_affinity_every_request_goes_by_load():
    router = PrefixAffinityRouter(2, block_size=BLOCK, use_affinity=False)
    p = prompt(1, 3, [])
    decisions = [router.choose(p) for _ in range(4)]
    assert [d.reason for d in decisions] == ["load"] * 4
    assert [d.replica for d in decisions] == [0, 1, 0, 1]  # equal loads take turns
