"""A hybrid model's snapshots in the prefix cache's tier (core/kv_tier_access.py), with the
fake runner standing in for the disk and the recurrent state (it checks that a request's
state slot holds exactly the history before the position it computes from)."""

from __future__ import annotations

from core_harness import TIER_ENTRY_BYTES, FakeRunner, assert_drained, make_request, make_scheduler, run_to_completion, step

from pagellm.core.kv_tier import block_digest, state_key

BLOCK = 4
INTERVAL = 2  # a snapshot after every 8 tokens


def hybrid_scheduler(**kwargs: object):  # noqa: ANN201 - a Scheduler
    args: dict[str, object] = dict(
        block_size=BLOCK, num_gpu_blocks=24, max_model_len=64, kv_offload_bytes=10_000,
        num_state_slots=4, num_state_snapshots=4, state_snapshot_interval=INTERVAL, max_num_seqs=4,
    )  # fmt: skip
    args.update(kwargs)
    return make_scheduler(**args)


def first_turn(**kwargs: object):  # noqa: ANN201
    """A 22-token prompt and 3 outputs served to the end, the engine then idle."""
    scheduler, runner = hybrid_scheduler(**kwargs), FakeRunner(BLOCK)
    first = make_request("a", 22, max_tokens=3)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    return scheduler, runner, first


def restarted(runner: FakeRunner, **kwargs: object):  # noqa: ANN201
    """A new engine on the same tier: an empty device, the index seeded from the disk."""
    scheduler = hybrid_scheduler(**kwargs)
    assert scheduler.kv_cache_manager.tier is not None
    scheduler.kv_cache_manager.tier.seed((key, TIER_ENTRY_BYTES) for key in runner.tier)
    fresh = FakeRunner(BLOCK, fail_load=runner.fail_load)
    fresh.tier = dict(runner.tier)
    return scheduler, fresh


def test_the_idle_engine_sends_the_last_snapshot_and_blocks_to_the_tier() -> None:
    scheduler, runner, first = first_turn()
    # The last step computed position 23: block 6's KV and the snapshot after 24 tokens
    # are decided, and no step carried them yet.
    assert scheduler.has_unsent_tier_work()
    flush = step(scheduler, runner)
    assert not flush.output.num_scheduled_tokens and flush.output.blocks_to_offload
    hashes = first.get_block_hashes(BLOCK)
    assert [key for key, _ in flush.output.states_to_offload] == [state_key(block_digest(hashes[5]))]
    assert not scheduler.has_unsent_tier_work()
    assert all(block_digest(h) in runner.tier for h in hashes[:6])
    assert state_key(block_digest(hashes[3])) in runner.tier, "the snapshot after 16 tokens, from the prompt's step"
    assert_drained(scheduler)


def test_a_conversation_resumes_from_the_tier_after_a_restart() -> None:
    scheduler, runner, first = first_turn()
    step(scheduler, runner)
    scheduler, runner = restarted(runner)
    second = make_request("a2", list(first.prompt_token_ids) + list(first.output_token_ids) + [5, 6, 7, 8, 9], max_tokens=2)
    scheduler.add_request(second)
    loading = step(scheduler, runner)
    assert not loading.output.num_scheduled_tokens, "the loading request computes nothing in its load step"
    assert len(loading.output.blocks_to_load) == 6 and len(loading.output.states_to_load) == 1
    computing = step(scheduler, runner)
    # The fake runner checks the state slot holds the 24 tokens' history before it computes.
    assert computing.output.num_scheduled_tokens == {"a2": 30 - 24}, "only the new turn is computed"
    run_to_completion(scheduler, runner)
    assert second.num_cached_tokens == second.num_tier_tokens == 24
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and tier.stats.num_loaded_states == 1 and tier.stats.num_loaded_blocks == 6
    assert_drained(scheduler)


def test_a_failed_snapshot_load_is_looked_up_again_and_resumes_earlier() -> None:
    scheduler, runner, first = first_turn()
    step(scheduler, runner)
    latest = state_key(block_digest(first.get_block_hashes(BLOCK)[5]))
    runner.fail_load = lambda key: key == latest  # the file after 24 tokens is corrupt
    scheduler, runner = restarted(runner)
    second = make_request("a2", list(first.prompt_token_ids) + list(first.output_token_ids) + [5, 6, 7, 8, 9], max_tokens=2)
    scheduler.add_request(second)
    step(scheduler, runner)  # loads, and the state fails: back to waiting, looked up again
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and latest not in tier and tier.stats.num_failed_loads == 1
    assert second.num_computed_tokens == 0 and scheduler.num_waiting == 1
    scheduler.check_integrity()
    reloading = step(scheduler, runner)
    assert len(reloading.output.blocks_to_load) == 4 and len(reloading.output.states_to_load) == 1  # the one after 16
    computing = step(scheduler, runner)
    assert computing.output.num_scheduled_tokens == {"a2": 30 - 16}
    run_to_completion(scheduler, runner)
    assert second.num_cached_tokens == 16
    assert_drained(scheduler)


def test_the_cost_rule_weighs_the_history_a_snapshot_saves() -> None:
    scheduler, runner, first = first_turn()
    step(scheduler, runner)
    scheduler, runner = restarted(runner)
    cost = scheduler.kv_cache_manager.tier_cost
    cost.observe_compute(1000, 1.0)  # 1 ms a token
    # 7 entries (6 blocks and the state) of 10 bytes each take 70 ms to read: less than
    # the 24 tokens' 24 ms? No: computed instead.
    cost.observe_read(70, 0.070)
    second = make_request("a2", list(first.prompt_token_ids) + list(first.output_token_ids) + [5, 6, 7, 8, 9], max_tokens=2)
    scheduler.add_request(second)
    result = step(scheduler, runner)
    assert not result.output.blocks_to_load and result.output.num_scheduled_tokens == {"a2": 30}
    run_to_completion(scheduler, runner)
    tier = scheduler.kv_cache_manager.tier
    assert tier is not None and tier.stats.num_skipped_blocks == 7 and tier.stats.num_hit_blocks == 0


def test_snapshots_under_an_adapter_stay_out_of_the_tier() -> None:
    scheduler, runner = hybrid_scheduler(max_loras=1), FakeRunner(BLOCK)
    request = make_request("a", 22, max_tokens=3, lora=1)
    scheduler.add_request(request)
    run_to_completion(scheduler, runner)
    step(scheduler, runner)
    assert not runner.tier and scheduler.kv_cache_manager.snapshots.num_saved == 2
    assert_drained(scheduler)
