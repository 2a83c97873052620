"""KV cache groups with sliding windows: a sliding group's blocks are freed exactly when
no query of the request can read them again, never earlier, and prefix hits, swap and
forks keep the freed entries straight."""

from __future__ import annotations

import pytest
from core_harness import FakeRunner, assert_drained, make_request, make_scheduler, run_to_completion

from pagellm.config import CacheConfig
from pagellm.core import KVCacheManager
from pagellm.core.block_pool import NULL_BLOCK_ID
from pagellm.errors import InvalidRequestError

BLOCK = 4
WINDOW = 6


def make_manager(group_windows, num_gpu_blocks=64, num_cpu_blocks=0, caching=True) -> KVCacheManager:
    config = CacheConfig(
        block_size=BLOCK,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        enable_prefix_caching=caching,
        group_windows=group_windows,
    )
    return KVCacheManager(config, max_model_len=256)


def compute(kv: KVCacheManager, request, num_tokens: int, computed=None) -> None:
    """One step: allocate, 'compute', register and free what the window passed."""
    assert kv.allocate_slots(request, num_tokens, computed) is not None
    if computed is not None:
        request.num_computed_tokens = computed.num_computed_tokens
    request.num_computed_tokens += num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)
    kv.free_passed_blocks(request)
    kv.check_integrity([request])


def still_readable(block_index: int, num_computed: int, window: int) -> bool:
    """Reference: some later query (position >= num_computed) sees a key of the block,
    i.e. the block's last position lies within the window of the next query."""
    last_position = (block_index + 1) * BLOCK - 1
    return last_position > num_computed - window


def test_blocks_are_freed_exactly_when_the_window_passes_them() -> None:
    kv = make_manager((None, WINDOW))
    request = make_request("a", 60, max_tokens=1)
    for chunk in [5, 5, 1, 7, 1, 1, 1, 13, 3, 1, 1, 1, 1, 1, 9]:
        compute(kv, request, chunk)
        global_table, sliding_table = kv.get_block_ids("a", 0), kv.get_block_ids("a", 1)
        assert NULL_BLOCK_ID not in global_table
        expected = [still_readable(i, request.num_computed_tokens, WINDOW) for i in range(len(sliding_table))]
        assert [block_id != NULL_BLOCK_ID for block_id in sliding_table] == expected
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.stats.num_window_freed_blocks == sum(1 for b in sliding_table if b == NULL_BLOCK_ID)


def test_a_long_hybrid_request_holds_its_global_blocks_and_one_window() -> None:
    # One global and three sliding groups (a 1 : 3 layout): at 200 tokens the request
    # holds 50 global blocks and, per sliding group, the blocks of its last window.
    kv = make_manager((None, WINDOW, WINDOW, WINDOW), num_gpu_blocks=256)
    request = make_request("a", 200, max_tokens=1)
    compute(kv, request, 16)
    while request.num_computed_tokens < 200:
        compute(kv, request, 1)
    num_blocks = 200 // BLOCK
    window_blocks = num_blocks - (200 - WINDOW + 1) // BLOCK
    assert window_blocks == 2
    assert kv.num_blocks_held("a") == num_blocks + 3 * window_blocks
    # Against the same request with every group global: (1 + 3 * 2 / 50) / 4 of it.
    assert kv.num_blocks_held("a") / (4 * num_blocks) == (1 + 3 * window_blocks / num_blocks) / 4
    kv.free(request)


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_group() -> None:
    kv = make_manager((None, WINDOW))
    prompt = list(range(100, 130))
    a = make_request("a", prompt, max_tokens=1)
    compute(kv, a, 30)
    kv.free(a)  # every block cached and free, the window's early ones freed long before
    b = make_request("b", prompt + [7, 8], max_tokens=1)
    hit = kv.get_computed_blocks(b)
    assert hit.num_computed_tokens == 28
    global_hit, sliding_hit = hit.blocks
    assert NULL_BLOCK_ID not in global_hit and len(global_hit) == 7
    # The next query (position 28) sees positions 23.. : blocks 5 and 6 only.
    assert sliding_hit[:5] == [NULL_BLOCK_ID] * 5 and NULL_BLOCK_ID not in sliding_hit[5:]
    compute(kv, b, 4, hit)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_no_hit_when_the_window_blocks_are_gone() -> None:
    kv = make_manager((None, WINDOW))
    prompt = list(range(100, 130))
    a = make_request("a", prompt, max_tokens=1)
    compute(kv, a, 30)
    # The sliding blocks the window passed are free; forget their content. The global
    # group still holds (and has cached) every block, the sliding group only 23.. .
    kv.reset_prefix_cache()
    b = make_request("b", prompt + [7, 8], max_tokens=1)
    # Every hit length h needs the sliding blocks from (h * 4 - 5) // 4 on, and each of
    # those sets contains a block the window freed: no hit at all.
    assert kv.get_computed_blocks(b).num_computed_tokens == 0
    kv.free(a)


def test_swap_keeps_the_freed_entries_and_copies_only_live_blocks() -> None:
    kv = make_manager((None, WINDOW), num_gpu_blocks=32, num_cpu_blocks=32)
    request = make_request("a", 40, max_tokens=1)
    compute(kv, request, 22)
    tables = [kv.get_block_ids("a", g) for g in (0, 1)]
    pairs = kv.swap_out(request)
    assert pairs is not None
    assert [device for device, _ in pairs] == [b for t in tables for b in t if b != NULL_BLOCK_ID]
    assert kv.can_swap_in(request, 1)
    back = kv.swap_in(request)
    assert back is not None and len(back) == len(pairs)
    swapped_in = kv.get_block_ids("a", 1)
    assert [b == NULL_BLOCK_ID for b in swapped_in] == [b == NULL_BLOCK_ID for b in tables[1]]
    kv.check_integrity([request])
    compute(kv, request, 1)
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_scheduler_runs_sliding_requests_with_forks_and_preemption() -> None:
    # Requests longer than the pool holds as global blocks run because the sliding
    # group lets go of its window's past; n = 2 forks share the prompt's live blocks.
    for mode in ("recompute", "swap"):
        windows = (None, 3, 3)
        scheduler = make_scheduler(
            num_gpu_blocks=40, num_cpu_blocks=40, max_model_len=64, max_num_batched_tokens=8,
            preemption_mode=mode, group_windows=windows,
        )  # fmt: skip
        runner = FakeRunner(BLOCK, group_windows=windows)
        for index in range(4):
            scheduler.add_request(make_request(f"r{index}", 20 + index, max_tokens=30, n=1 + index % 2))
        results = run_to_completion(scheduler, runner)
        assert scheduler.kv_cache_manager.stats.num_window_freed_blocks > 0
        assert any(r.output.preempted_req_ids for r in results), "the pool was meant to run short"
        assert_drained(scheduler)


def test_admission_counts_a_window_not_the_whole_request() -> None:
    # 19 usable blocks. A 60-token request needs 15 blocks in its global group; in its
    # sliding group (window 3, steps of at most 8 tokens) 4, not 15.
    scheduler = make_scheduler(num_gpu_blocks=20, max_model_len=64, max_num_batched_tokens=8, group_windows=(None, 3))
    scheduler.add_request(make_request("fits", 40, max_tokens=20))
    run_to_completion(scheduler, FakeRunner(BLOCK, group_windows=(None, 3)))
    assert_drained(scheduler)
    both_global = make_scheduler(num_gpu_blocks=20, max_model_len=64, max_num_batched_tokens=8, group_windows=(None, None))
    with pytest.raises(InvalidRequestError, match="needs 20 KV cache blocks"):
        both_global.add_request(make_request("too long", 40, max_tokens=20))
