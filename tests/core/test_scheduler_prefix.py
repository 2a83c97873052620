"""Automatic prefix caching through the scheduler: hits, sharing, duplicates, stats."""

from __future__ import annotations

from core_harness import FakeRunner, assert_drained, make_request, scheduled, step


def refs(scheduler, block_ids: list[int]) -> list[int]:
    blocks = scheduler.kv_cache_manager.device_pool.blocks
    return [blocks[i].ref_cnt for i in block_ids]


def finish_all(scheduler, runner) -> None:
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)


def test_a_later_request_shares_the_cached_prefix_blocks(new_scheduler) -> None:
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    a = make_request("a", list(range(10)), max_tokens=3)
    scheduler.add_request(a)
    r1 = step(scheduler, runner)
    assert r1.output.scheduled_new_reqs[0].block_ids == [[1, 2, 3]]

    b = make_request("b", list(range(8)) + [50, 51, 52], max_tokens=3)
    scheduler.add_request(b)
    r2 = step(scheduler, runner)
    assert scheduled(r2) == {"a": 1, "b": 3}
    new = r2.output.scheduled_new_reqs[0]
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("b", [[1, 2, 4]], 8)
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert refs(scheduler, [1, 2, 3, 4]) == [2, 2, 1, 1]
    stats = scheduler.make_stats()
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (21, 8)

    finish_all(scheduler, runner)
    assert a.output_token_ids == b.output_token_ids == [7, 7, 7]
    assert_drained(scheduler)


def test_a_fully_cached_prompt_still_computes_its_last_token(new_scheduler) -> None:
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(8)), max_tokens=1))
    finish_all(scheduler, runner)
    scheduler.add_request(make_request("same", list(range(8)), max_tokens=1))
    result = step(scheduler, runner)
    # Block-aligned prompt: the last block is given up so that 4 tokens are computed.
    assert scheduled(result) == {"same": 4}
    assert result.output.scheduled_new_reqs[0].num_computed_tokens == 4
    scheduler.add_request(make_request("longer", list(range(9)), max_tokens=1))
    assert scheduled(step(scheduler, runner)) == {"longer": 1}
    assert_drained(scheduler)


def test_identical_prompts_admitted_together_cache_one_copy(new_scheduler) -> None:
    scheduler = new_scheduler()
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=2))
    scheduler.add_request(make_request("b", list(range(10)), max_tokens=2))
    r1 = step(scheduler, runner)
    assert {n.req_id: n.block_ids[0] for n in r1.output.scheduled_new_reqs} == {
        "a": [1, 2, 3],
        "b": [4, 5, 6],
    }
    pool = scheduler.kv_cache_manager.device_pool
    assert [pool.blocks[i].block_hash is not None for i in range(1, 7)] == [
        True, True, False, False, False, False,
    ]
    scheduler.add_request(make_request("c", list(range(10)), max_tokens=1))
    r2 = step(scheduler, runner)
    assert r2.output.scheduled_new_reqs[0].block_ids == [[1, 2, 7]]
    finish_all(scheduler, runner)
    assert_drained(scheduler)


def test_decoded_tokens_fill_blocks_that_become_hits(new_scheduler) -> None:
    scheduler = new_scheduler()
    runner = FakeRunner(4, sample=lambda rid, tokens: 100 + len(tokens))
    a = make_request("a", list(range(6)), max_tokens=4)
    scheduler.add_request(a)
    finish_all(scheduler, runner)
    assert a.all_token_ids == [0, 1, 2, 3, 4, 5, 106, 107, 108, 109]
    # Positions 0..8 were computed: blocks [0..3] and [4, 5, 106, 107] are full.
    follow_up = make_request("f", a.all_token_ids + [1, 2], max_tokens=1)
    scheduler.add_request(follow_up)
    result = step(scheduler, runner)
    assert result.output.scheduled_new_reqs[0].num_computed_tokens == 8
    assert scheduled(result) == {"f": 4}
    assert_drained(scheduler)


def test_prefix_caching_off_never_hits(new_scheduler) -> None:
    scheduler = new_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=1))
    finish_all(scheduler, runner)
    scheduler.add_request(make_request("b", list(range(10)), max_tokens=1))
    assert scheduled(step(scheduler, runner)) == {"b": 10}
    stats = scheduler.make_stats()
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (0, 0)
    assert_drained(scheduler)


def test_a_fork_copies_its_shared_block_once_the_parent_filled_and_cached_it() -> None:
    """n = 2, a one-token prompt in blocks of 2: the parent fills the shared block with
    its first output (the block enters the prefix cache under the parent's tokens) and
    finishes before its child runs. The child must still copy the block before writing
    its own token there, or the cached block would hold the child's token: a later
    prompt matching the parent's tokens would read it (the fake runner checks reads)."""
    from core_harness import FakeRunner, assert_drained, make_request, make_scheduler, run_to_completion, step

    def by_request(request_id: str, tokens: list[int]) -> int:
        return 50 + len(tokens) + (100 if "#" in request_id else 0)  # children differ

    scheduler = make_scheduler(block_size=2, num_gpu_blocks=8, max_num_batched_tokens=1, max_model_len=8)
    runner = FakeRunner(2, sample=by_request)
    parent = make_request("p", [11], max_tokens=2, n=2)
    scheduler.add_request(parent)
    step(scheduler, runner)  # the prompt: the parent's first token and the child's
    step(scheduler, runner)  # a budget of 1: only the parent runs, fills the block, ends
    assert parent.is_finished
    copies = step(scheduler, runner).output.blocks_to_copy  # the child's turn
    assert len(copies) == 1
    follower = make_request("f", [11, *parent.output_token_ids[:1], 70], max_tokens=1)
    scheduler.add_request(follower)
    run_to_completion(scheduler, runner)
    assert follower.num_cached_tokens == 2  # it read the parent's block from the cache
    step(scheduler, runner)
    assert_drained(scheduler)


def test_a_fork_in_a_full_pool_takes_over_the_block_only_the_cache_holds() -> None:
    """As above, but the pool has no block to copy into: the shared block, which only its
    cache entry still holds, leaves the prefix cache and the child writes it in place. No
    step idles (a preemption would free the child's own block and schedule nothing), and
    the child's tokens are its own (the fake runner checks what it reads)."""
    from core_harness import FakeRunner, assert_drained, make_request, make_scheduler, step

    def by_request(request_id: str, tokens: list[int]) -> int:
        return 50 + len(tokens) + (100 if "#" in request_id else 0)  # children differ

    scheduler = make_scheduler(block_size=2, num_gpu_blocks=2, max_num_batched_tokens=1, max_model_len=3)
    runner = FakeRunner(2, sample=by_request)
    parent = make_request("p", [11], max_tokens=2, n=2)
    scheduler.add_request(parent)
    step(scheduler, runner)  # the prompt: both completions' first token
    step(scheduler, runner)  # a budget of 1: only the parent runs, fills the block, ends
    assert parent.is_finished and scheduler.kv_cache_manager.num_free_blocks == 0
    output = step(scheduler, runner).output  # the child's turn, in the one usable block
    assert output.num_scheduled_tokens and not output.blocks_to_copy
    while scheduler.has_unfinished_requests():
        assert not step(scheduler, runner).output.is_empty
    step(scheduler, runner)
    assert_drained(scheduler)
