"""The prefix cache's second tier as the scheduler sees it (core/kv_tier.py), with the
fake runner standing in for the disk: digests, the index's bound and write queue, the
two-step admission of a request that loads its prefix, failed loads, the cost rule."""

from __future__ import annotations

from core_harness import TIER_ENTRY_BYTES, FakeRunner, assert_drained, make_request, make_scheduler, run_to_completion, step

from pagellm.core.kv_tier import TierCostModel, TierIndex, TierReport, block_digest
from pagellm.request import BlockHash

BLOCK = 4


def tier_scheduler(num_gpu_blocks: int = 9, tier_bytes: int = 10_000, pending: int = 256, **kwargs: object):
    return make_scheduler(
        block_size=BLOCK,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=32,
        kv_offload_bytes=tier_bytes,
        kv_offload_max_pending_writes=pending,
        **kwargs,
    )


def serve(scheduler, runner, request) -> None:  # noqa: ANN001
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)


def test_digest_is_chained_deterministic_and_cached() -> None:
    a1 = BlockHash(None, (1, 2, 3, 4))
    a2 = BlockHash(a1, (5, 6, 7, 8))
    b1 = BlockHash(None, (1, 2, 3, 4))
    b2 = BlockHash(b1, (5, 6, 7, 8))
    c2 = BlockHash(BlockHash(None, (1, 2, 3, 9)), (5, 6, 7, 8))
    assert block_digest(a2) == block_digest(b2) and len(block_digest(a2)) == 16
    assert block_digest(c2) != block_digest(a2), "the parent's tokens are part of a block's key"
    assert a1.digest is not None and a2.digest == block_digest(a2)
    # A value pinned in the test: a restarted process must compute the same keys.
    assert block_digest(BlockHash(None, (0,))).hex() == block_digest(BlockHash(None, (0,))).hex()
    assert block_digest(BlockHash(None, (1,))) != block_digest(BlockHash(None, (-1,)))


def test_index_bound_evicts_least_recently_used_and_queue_drops() -> None:
    index = TierIndex(capacity_bytes=30, max_pending_writes=2)
    assert index.offer_write(b"a") and index.offer_write(b"b")
    assert not index.offer_write(b"c"), "a full write queue drops the block"
    assert index.stats.num_dropped_writes == 1
    assert not index.offer_write(b"a"), "a write in flight is not queued twice"
    index.apply_report(TierReport([(b"a", 10), (b"b", 10)], [], [], 0, 0, 0.0))
    assert len(index) == 2 and index.num_bytes == 20 and not index.pending_writes
    index.touch([b"a"])  # b is now the least recently used
    for name in (b"c", b"d"):
        assert index.offer_write(name)
    index.apply_report(TierReport([(b"c", 10), (b"d", 10)], [], [], 0, 0, 0.0))
    assert b"b" not in index and b"a" in index and index.num_bytes == 30
    assert index.take_deletions() == [b"b"] and index.take_deletions() == []
    index.apply_report(TierReport([], [], [b"a"], 0, 0, 0.0))
    assert b"a" not in index and index.stats.num_failed_loads == 1
    index.check_integrity()


def test_cost_rule_follows_the_measurements() -> None:
    cost = TierCostModel(block_size=16, smoothing=1.0)
    block = (1000, 16)  # a block of 1000 bytes holding 16 tokens
    assert cost.loading_pays(*block), "until measured, loading is tried"
    cost.observe_read(num_bytes=10_000, seconds=0.010)  # 1 ms for a block's bytes
    cost.observe_compute(num_prompt_tokens=4, seconds=1.0)  # a decode-sized step says nothing
    assert cost.compute_seconds_per_token is None
    cost.observe_compute(num_prompt_tokens=1000, seconds=0.5)  # 0.5 ms a token: 8 ms a block
    assert cost.loading_pays(*block)
    cost.observe_read(num_bytes=1000, seconds=0.020)  # 20 ms a block
    verdicts = [cost.loading_pays(*block) for _ in range(2 * cost.probe_every)]
    # Computed instead, but one lookup in probe_every still loads, to measure again.
    assert verdicts.count(True) == 2 and verdicts[cost.probe_every - 1] and verdicts[-1]
    # A hybrid's snapshot beside the block: 1000 bytes more to read (40 ms), but the 80
    # tokens of history before the block are saved too (48 ms).
    assert cost.loading_pays(2000, 96)
    cost.observe_read(num_bytes=4000, seconds=0.004)  # the probe read fast: loading pays again
    assert all(cost.loading_pays(*block) for _ in range(3))


def test_an_evicted_prefix_is_loaded_back_in_a_step_of_its_own() -> None:
    scheduler = tier_scheduler()
    runner = FakeRunner(BLOCK)
    first = make_request("a", 20, max_tokens=2)
    serve(scheduler, runner, first)
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and len(tier) == 5  # 20 prompt + 1 fed-back token: 5 full blocks
    # Other traffic takes every block, evicting a's from the device cache.
    serve(scheduler, runner, make_request("b", 30, max_tokens=2))
    assert all(scheduler.kv_cache_manager.device_pool.get_cached_block(h) is None for h in first.get_block_hashes(BLOCK)[:4])

    again = make_request("a2", list(first.prompt_token_ids) + [5, 6, 7], max_tokens=2)
    scheduler.add_request(again)
    loading = step(scheduler, runner)
    assert loading.output.num_scheduled_tokens == {}, "the loading request computes nothing in its load step"
    assert len(loading.output.blocks_to_load) == 5
    computing = step(scheduler, runner)
    assert computing.output.num_scheduled_tokens == {"a2": 3}, "only the new turn is computed"
    assert computing.output.scheduled_new_reqs[0].num_computed_tokens == 20
    run_to_completion(scheduler, runner)
    assert again.num_cached_tokens == again.num_tier_tokens == 20
    assert tier.stats.num_hit_blocks == 5 and tier.stats.num_loaded_blocks == 5
    assert_drained(scheduler)


def test_a_prefix_whose_writes_are_in_flight_is_loaded() -> None:
    """A conversation back before the tier reported its blocks written: they count as held
    (the runner's loader waits for its queued writes), so it loads rather than computes."""
    scheduler = tier_scheduler()
    runner = FakeRunner(BLOCK)
    runner.hold_write_reports = True
    first = make_request("a", 20, max_tokens=2)
    serve(scheduler, runner, first)
    serve(scheduler, runner, make_request("b", 30, max_tokens=2))
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and len(tier) == 0 and len(tier.pending_writes) >= 5  # nothing reported written
    again = make_request("a2", list(first.prompt_token_ids) + [5, 6, 7], max_tokens=2)
    scheduler.add_request(again)
    loading = step(scheduler, runner)
    assert len(loading.output.blocks_to_load) == 5
    runner.hold_write_reports = False
    run_to_completion(scheduler, runner)  # the fake runner checks every position read
    assert again.num_cached_tokens == again.num_tier_tokens == 20
    assert len(tier) >= 5  # reported since
    tier.check_integrity()
    assert_drained(scheduler)


def test_a_failed_load_computes_from_that_block_on() -> None:
    scheduler = tier_scheduler()
    failing: set[bytes] = set()
    runner = FakeRunner(BLOCK, fail_load=lambda digest: digest in failing)
    first = make_request("a", 20, max_tokens=2)
    serve(scheduler, runner, first)
    serve(scheduler, runner, make_request("b", 30, max_tokens=2))
    failing.add(block_digest(first.get_block_hashes(BLOCK)[2]))  # the third block is corrupt
    again = make_request("a2", list(first.prompt_token_ids) + [5], max_tokens=2)
    scheduler.add_request(again)
    step(scheduler, runner)
    computing = step(scheduler, runner)
    assert computing.output.scheduled_new_reqs[0].num_computed_tokens == 8  # two good blocks
    run_to_completion(scheduler, runner)  # the fake runner checks every position read
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and tier.stats.num_failed_loads == 1
    assert again.num_cached_tokens == 8
    assert_drained(scheduler)


def test_a_full_write_queue_drops_and_the_bound_holds_under_churn() -> None:
    scheduler = tier_scheduler(tier_bytes=7 * TIER_ENTRY_BYTES, pending=2)
    runner = FakeRunner(BLOCK)
    for index in range(12):
        scheduler.add_request(make_request(f"r{index}", 24, max_tokens=1))
    run_to_completion(scheduler, runner)
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None
    assert tier.stats.num_dropped_writes > 0, "several requests' blocks arrive in one step"
    assert tier.stats.num_evicted_blocks > 0 and tier.num_bytes <= 7 * TIER_ENTRY_BYTES
    for _ in range(2):  # the last writes, then the deletions they caused, reach the runner
        step(scheduler, runner)
    assert all(digest in tier for digest in runner.tier), "the disk keeps what the index dropped"
    assert len(runner.tier) == len(tier)
    assert_drained(scheduler)


def test_the_cost_rule_computes_instead_of_loading() -> None:
    scheduler = tier_scheduler()
    runner = FakeRunner(BLOCK)
    first = make_request("a", 20, max_tokens=2)
    serve(scheduler, runner, first)
    serve(scheduler, runner, make_request("b", 30, max_tokens=2))
    cost = scheduler.kv_cache_manager.tier_cost
    cost.observe_compute(1000, 0.001)  # 1 us a token
    cost.observe_read(1, 1.0)  # 1 s a byte
    again = make_request("a2", list(first.prompt_token_ids) + [5], max_tokens=2)
    scheduler.add_request(again)
    result = step(scheduler, runner)
    assert not result.output.blocks_to_load and result.output.num_scheduled_tokens["a2"] == 21
    run_to_completion(scheduler, runner)
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and tier.stats.num_skipped_blocks == 5 and tier.stats.num_hit_blocks == 0


def test_adapters_and_caching_off_stay_out_of_the_tier() -> None:
    scheduler = tier_scheduler(max_loras=1)
    runner = FakeRunner(BLOCK)
    serve(scheduler, runner, make_request("a", 20, max_tokens=2, lora=1))
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and len(tier) == 0 and not runner.tier
    off = tier_scheduler(enable_prefix_caching=False)
    assert off.kv_cache_manager.tier is None


def test_an_abort_while_loading_frees_the_blocks() -> None:
    scheduler = tier_scheduler()
    runner = FakeRunner(BLOCK)
    first = make_request("a", 20, max_tokens=2)
    serve(scheduler, runner, first)
    serve(scheduler, runner, make_request("b", 30, max_tokens=2))
    scheduler.add_request(make_request("a2", list(first.prompt_token_ids) + [5], max_tokens=2))
    out = scheduler.schedule()
    assert out.blocks_to_load
    from pagellm.request import RequestStatus

    scheduler.finish_requests("a2", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(out, runner.execute(out))
    step(scheduler, runner)
    assert_drained(scheduler)


def test_a_window_that_passes_device_hit_blocks_within_the_loaded_run() -> None:
    # A sliding-window model (one group, window 3, blocks of one token) whose preempted
    # request resumes from a device hit of blocks [10] and [10, 11] and loads [10, 11, 12]
    # from the tier: at the loaded run's end the window has passed the first device-hit
    # block, which must enter the table as NULL (not be taken and held). Found by
    # test_scheduler_property.py.
    scheduler = make_scheduler(
        block_size=1, num_gpu_blocks=5, max_model_len=5, max_num_seqs=2, max_num_batched_tokens=5,
        enable_chunked_prefill=False, group_windows=(3,), kv_offload_bytes=30, kv_offload_max_pending_writes=3,
    )  # fmt: skip
    runner = FakeRunner(1, group_windows=(3,))
    for request_id, prompt, max_tokens in (("r0", [10], 3), ("r1", [10], 1), ("r2", [10, 11, 12], 2)):
        scheduler.add_request(make_request(request_id, prompt, max_tokens=max_tokens, ignore_eos=True))
    results = run_to_completion(scheduler, runner)
    loads = [r.output.blocks_to_load for r in results if r.output.blocks_to_load]
    assert loads, "the scenario no longer resumes through a tier load"
    stats = scheduler.make_stats()
    assert stats.num_preemptions_recompute > 0 and scheduler.kv_cache_manager.stats.num_prefix_hit_tokens > 0
    assert_drained(scheduler)
