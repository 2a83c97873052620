"""KV cache manager: block tables, prefix hits, allocation failure, free order, swap."""

from __future__ import annotations

from core_harness import make_request

from pagellm.config import CacheConfig
from pagellm.core import ComputedBlocks, KVCacheManager


def make_manager(num_gpu_blocks: int = 9, num_cpu_blocks: int = 0, caching: bool = True):
    config = CacheConfig(
        block_size=4,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        enable_prefix_caching=caching,
    )
    return KVCacheManager(config, max_model_len=64)


def assert_manager_drained(kv: KVCacheManager) -> None:
    kv.check_integrity()
    assert not kv.request_ids_holding_blocks()
    for pool in (kv.device_pool, kv.host_pool):
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert all(block.ref_cnt == 0 for block in pool.blocks)


def compute(kv: KVCacheManager, request, num_tokens: int, computed=None) -> list[int]:
    """Allocate for and 'compute' num_tokens more tokens, as a scheduler step would;
    returns the first group's new block ids."""
    new_ids = kv.allocate_slots(request, num_tokens, computed)
    assert new_ids is not None and len(new_ids) == kv.num_groups
    return_group0 = new_ids[0]
    if computed is not None:
        request.num_computed_tokens = computed.num_computed_tokens
    request.num_computed_tokens += num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)
    kv.free_passed_blocks(request)
    return return_group0


def refs(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [kv.device_pool.blocks[i].ref_cnt for i in block_ids]


def test_allocate_grows_the_table_by_whole_blocks() -> None:
    kv = make_manager()
    request = make_request("a", 10)
    assert compute(kv, request, 3) == [1]
    assert compute(kv, request, 1) == []  # 4 tokens still fit block 1
    assert compute(kv, request, 6) == [2, 3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.stats.num_allocation_attempts == 3
    kv.free(request)
    assert_manager_drained(kv)


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    kv = make_manager()
    a = make_request("a", list(range(10)))
    compute(kv, a, 10)  # blocks 1 2 3; 1 and 2 are full, so cached
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hit = kv.get_computed_blocks(b)
    assert hit == ComputedBlocks([[1, 2]], 8)
    assert compute(kv, b, 3, hit) == [4]
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert refs(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert kv.stats.num_prefix_query_tokens == 11
    assert kv.stats.num_prefix_hit_tokens == 8
    kv.free(a)
    assert refs(kv, [1, 2, 3]) == [1, 1, 0]
    kv.free(b)
    assert_manager_drained(kv)


def test_the_last_token_is_always_left_to_compute() -> None:
    kv = make_manager()
    a = make_request("a", list(range(8)))
    compute(kv, a, 8)  # two full blocks, both cached
    kv.free(a)
    # Same 8-token prompt: its last block would leave nothing to compute, so it is dropped.
    same = make_request("same", list(range(8)))
    assert kv.get_computed_blocks(same) == ComputedBlocks([[1]], 4)
    # With one more token both blocks are hits.
    longer = make_request("longer", list(range(9)))
    assert kv.get_computed_blocks(longer) == ComputedBlocks([[1, 2]], 8)
    assert_manager_drained(kv)  # lookups reserve nothing


def test_failed_allocation_changes_nothing_not_even_the_hit_blocks() -> None:
    kv = make_manager(num_gpu_blocks=4)  # 3 usable blocks
    a = make_request("a", list(range(5)))
    compute(kv, a, 5)  # blocks 1 (cached) and 2
    kv.free(a)  # queue: 2 (uncached, head) 3 1 (cached, tail)
    filler = make_request("filler", 2)
    compute(kv, filler, 2)  # takes block 2
    b = make_request("b", list(range(4)) + list(range(100, 109)))  # needs 4 blocks
    hit = kv.get_computed_blocks(b)
    assert hit == ComputedBlocks([[1]], 4)
    free_before = list(kv.device_pool.free_queue)
    attempts, failures = kv.stats.num_allocation_attempts, kv.stats.num_allocation_failures
    assert kv.allocate_slots(b, 9, hit) is None
    assert list(kv.device_pool.free_queue) == free_before
    assert refs(kv, [1]) == [0] and kv.device_pool.blocks[1].block_hash is not None
    assert kv.get_block_ids("b") == [] and not kv.holds_blocks("b")
    assert kv.stats.num_allocation_attempts == attempts + 1
    assert kv.stats.num_allocation_failures == failures + 1
    # Lookups count only once the request is admitted with them.
    assert kv.stats.num_prefix_query_tokens == kv.stats.num_prefix_hit_tokens == 0
    kv.free(filler)
    assert_manager_drained(kv)


def test_free_releases_the_tail_first_so_it_is_evicted_first() -> None:
    kv = make_manager(num_gpu_blocks=5)  # blocks 1..4
    a = make_request("a", list(range(13)))
    compute(kv, a, 13)  # blocks 1 2 3 cached, 4 holds one token
    kv.free(a)
    # Uncached 4 goes to the head; the chain queues tail first: 3, 2, 1.
    assert [b.block_id for b in kv.device_pool.free_queue] == [4, 3, 2, 1]
    taker = make_request("taker", 8)
    assert compute(kv, taker, 8) == [4, 3]  # block 3, the chain's tail, is evicted
    again = make_request("again", list(range(13)))
    assert kv.get_computed_blocks(again) == ComputedBlocks([[1, 2]], 8)
    kv.free(taker)
    assert_manager_drained(kv)


def test_swap_out_and_in_copy_every_computed_block() -> None:
    kv = make_manager(num_gpu_blocks=9, num_cpu_blocks=4)
    a = make_request("a", list(range(6)))
    compute(kv, a, 6)  # blocks 1 (cached) 2
    b = make_request("b", list(range(4)) + [60, 61, 62])
    hit = kv.get_computed_blocks(b)
    compute(kv, b, 3, hit)  # shares 1, new 3
    assert kv.get_block_ids("b") == [1, 3]
    # Allocated but not yet computed slots are not copied.
    assert kv.allocate_slots(b, 2) == [[4]]
    pairs = kv.swap_out(b)
    assert pairs == [(1, 0), (3, 1)]  # the shared block's content is copied too
    assert kv.is_swapped_out("b") and kv.get_block_ids("b") == []
    assert refs(kv, [1, 3, 4]) == [1, 0, 0]  # only b's reference on block 1 dropped
    assert kv.get_host_block_ids("b") == [0, 1]
    assert kv.can_swap_in(b, num_new_tokens=1)
    back = kv.swap_in(b)
    # Freed uncached blocks went to the queue head (3 then 4), so they come back first.
    assert back == [(0, 3), (1, 4)]
    assert kv.get_block_ids("b") == [3, 4]
    assert kv.host_pool.num_free_blocks == 4
    assert kv.stats.num_swapped_out_blocks == 2 and kv.stats.num_swapped_in_blocks == 2
    kv.free(a)
    kv.free(b)
    assert_manager_drained(kv)


def test_swap_fails_cleanly_without_room() -> None:
    kv = make_manager(num_gpu_blocks=4, num_cpu_blocks=1)
    a = make_request("a", 8)
    compute(kv, a, 8)
    assert kv.swap_out(a) is None  # 2 blocks, host has 1
    assert kv.get_block_ids("a") == [1, 2] and kv.host_pool.num_free_blocks == 1
    small = make_request("small", 3)
    compute(kv, small, 3)
    assert kv.swap_out(small) == [(3, 0)]
    big = make_request("big", 4)
    compute(kv, big, 4)  # takes the block small left
    assert not kv.can_swap_in(small)
    assert kv.swap_in(small) is None
    assert kv.is_swapped_out("small")
    for request in (a, small, big):
        kv.free(request)  # frees host blocks of a swapped request too
    assert_manager_drained(kv)



def test_check_integrity_catches_broken_tables() -> None:
    """Each invariant of core/kv_cache_integrity.py fails on tables that break it."""
    import pytest

    from pagellm.core.kv_swap import HostCopy

    def message(corrupt) -> str:  # noqa: ANN001
        kv = make_manager(num_cpu_blocks=4)
        request = make_request("r", list(range(1, 11)))
        compute(kv, request, 10)
        kv.check_integrity([request])
        corrupt(kv, request)
        with pytest.raises(AssertionError) as error:
            kv.check_integrity([request])
        return str(error.value)

    def table(kv: KVCacheManager) -> list[int]:
        return kv._block_tables["r"][0]

    assert "ref count" in message(lambda kv, r: table(kv).pop())  # a held block no table names
    assert "holds a block twice" in message(lambda kv, r: table(kv).append(table(kv)[0]))
    assert "on device and host at once" in message(lambda kv, r: kv._host_copies.__setitem__("r", HostCopy([[]], [0])))

    def other_tokens(kv: KVCacheManager, r) -> None:  # noqa: ANN001
        r._all_token_ids[0] = 99  # the cached first block no longer holds the request's tokens
        r._block_hashes.clear()

    assert "holding other tokens" in message(other_tokens)
