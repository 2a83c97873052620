"""Block pool: null block, ref counts, LRU free queue, lazy eviction, integrity checks."""

from __future__ import annotations

import random

import pytest

from pagellm.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pagellm.request import BlockHash


def ids(blocks: object) -> list[int]:
    return [block.block_id for block in blocks]  # type: ignore[attr-defined]


def key(*tokens: int, parent: BlockHash | None = None) -> BlockHash:
    return BlockHash(parent, tokens)


def assert_all_free(pool: BlockPool) -> None:
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def test_free_queue_operations() -> None:
    queue = FreeBlockQueue()
    blocks = [KVBlock(i) for i in range(5)]
    for block in blocks[1:4]:
        queue.append(block)
    queue.appendleft(blocks[0])
    queue.append(blocks[4])
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])  # from the middle, O(1)
    assert ids(queue) == [0, 1, 3, 4]
    assert not queue.is_queued(blocks[2])
    assert queue.popleft() is blocks[0]
    assert ids(queue) == [1, 3, 4] and len(queue) == 3
    for _ in range(3):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_never_used_blocks_are_made_when_first_allocated() -> None:
    pool = BlockPool(10_000_000, enable_caching=True)  # a tiny model's CPU budget: no object per block
    assert len(pool.blocks) == 1 and pool.num_free_blocks == 9_999_999 and pool.get_usage() == 0.0
    taken = pool.allocate(3)
    assert ids(taken) == [1, 2, 3] and len(pool.blocks) == 4
    assert all(pool.blocks[b.block_id] is b for b in taken)
    pool.free(taken)
    assert pool.num_free_blocks == 9_999_999
    pool.check_integrity()
    # The checks see a block that was never made but counted as free.
    pool.free_queue._num_unused -= 1
    with pytest.raises(AssertionError, match="never used"):
        pool.check_integrity()


def test_the_queue_order_is_that_of_every_block_queued_up_front() -> None:
    # A pool with the never-used range against a plain list holding every block from the
    # start, through random allocations, frees (cached ones at the tail, others at the
    # head), prefix hits on free cached blocks and resets: the same ids in the same order.
    rng = random.Random(3)
    pool = BlockPool(40, enable_caching=True)
    model = list(range(1, 40))  # the eager queue, head first
    held: list[int] = []
    cached: set[int] = set()
    for step in range(600):
        action = rng.random()
        if action < 0.45 and model:
            count = rng.randint(1, min(4, len(model)))
            got = ids(pool.allocate(count))
            assert got == model[:count], step
            del model[:count]
            cached -= set(got)
            held += got
        elif action < 0.8 and held:
            rng.shuffle(held)
            count = rng.randint(1, len(held))
            freed, held = held[:count], held[count:]
            for block_id in freed:
                if rng.random() < 0.5:
                    pool.cache_block(pool.blocks[block_id], key(block_id))
                    cached.add(block_id)
            pool.free(pool.blocks[b] for b in freed)
            for block_id in freed:
                if block_id in cached:
                    model.append(block_id)
                else:
                    model.insert(0, block_id)
        elif action < 0.9:
            free_cached = [b for b in model if b in cached]
            if free_cached:
                hit = rng.choice(free_cached)
                pool.touch([pool.blocks[hit]])
                model.remove(hit)
                held.append(hit)
        else:
            dropped = [b for b in model if b in cached]
            assert pool.reset_prefix_cache() == len(dropped)
            model = list(reversed(dropped)) + [b for b in model if b not in cached]
            cached -= set(dropped)
        assert pool.free_block_ids() == model, step
        pool.check_integrity()
    assert ids(pool.allocate(len(model))) == model


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == 4
    assert pool.null_block is pool.blocks[0]
    blocks = pool.allocate(4)
    assert ids(blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)
    pool.free(reversed(blocks))
    assert_all_free(pool)
    # The host pool variant has no null block.
    host = BlockPool(3, enable_caching=False, reserve_null_block=False)
    assert ids(host.allocate(3)) == [0, 1, 2]


def test_usage_and_ref_counts() -> None:
    pool = BlockPool(5, enable_caching=True)
    a, b = pool.allocate(2)
    assert pool.get_usage() == 0.5
    pool.touch([a])  # a second user (prefix sharing)
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([a, b])
    assert_all_free(pool)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a])


def test_freed_blocks_queue_uncached_first_then_cached_in_lru_order() -> None:
    pool = BlockPool(7, enable_caching=True)
    blocks = pool.allocate(4)  # 1 2 3 4
    k1 = key(1)
    k2 = key(2, parent=k1)
    assert pool.cache_block(blocks[0], k1) and pool.cache_block(blocks[1], k2)
    # A request frees its table tail first.
    pool.free(reversed(blocks))
    # Uncached 4 and 3 jump to the head (worthless), cached 2 then 1 queue at the tail.
    assert pool.free_block_ids() == [3, 4, 5, 6, 2, 1]
    # Cached blocks stay hit-able while free.
    assert pool.get_cached_block(key(1)) is blocks[0]
    assert_all_free(pool)


def test_lazy_eviction_when_a_cached_free_block_is_reused() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, key(1))
    pool.cache_block(b, key(2))
    pool.free([b, a])  # queue: b, a (b evicted first)
    assert pool.free_block_ids() == [2, 1]
    (taken,) = pool.allocate(1)
    assert taken is b and b.block_hash is None
    assert pool.get_cached_block(key(2)) is None  # evicted now, not when freed
    assert pool.get_cached_block(key(1)) is a
    assert pool.num_evictions == 1
    pool.free([taken])
    assert_all_free(pool)


def test_touch_pulls_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache_block(b, key(9))
    pool.free([a, b, c])
    hit = pool.get_cached_block(key(9))
    assert hit is b
    pool.touch([hit])
    assert b.ref_cnt == 1 and not pool.free_queue.is_queued(b)
    assert pool.free_block_ids() == [3, 1]
    pool.free([b])
    assert pool.free_block_ids() == [3, 1, 2]
    assert_all_free(pool)


def test_duplicate_content_is_registered_once() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, key(1, 2))
    assert not pool.cache_block(b, key(1, 2))
    assert b.block_hash is None
    assert not pool.cache_block(a, a.block_hash)  # already registered: no-op
    pool.free([a, b])
    assert_all_free(pool)


def test_caching_off_registers_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, key(1))
    assert pool.get_cached_block(key(1)) is None
    pool.free([a])
    assert_all_free(pool)


def test_reset_prefix_cache_forgets_free_cached_blocks_only() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, key(1))
    pool.cache_block(b, key(2))
    pool.free([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(key(1)) is None
    assert pool.get_cached_block(key(2)) is b
    pool.free([b])
    assert_all_free(pool)


def test_reset_blocks_are_reused_before_never_used_ones() -> None:
    # On a CPU a never-written block costs resident memory the first time it is written:
    # after a reset, the blocks whose content was dropped come back first (the most
    # recently freed at the head), as free() queues blocks that hold nothing reusable.
    pool = BlockPool(10, enable_caching=True)
    used = pool.allocate(4)
    for index, block in enumerate(used):
        pool.cache_block(block, key(index))
    pool.free(used)  # cached: queued at the tail, behind the 5 never-used blocks
    assert pool.allocate(1)[0] not in used  # before a reset a never-used block comes first
    assert pool.reset_prefix_cache() == 4
    again = pool.allocate(4)
    assert [b.block_id for b in again] == [b.block_id for b in reversed(used)]
    assert all(b.block_hash is None for b in again)
    pool.check_integrity()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: setattr(p.blocks[1], "ref_cnt", 1), "free with ref count 1"),
        (lambda p: setattr(p.blocks[1], "ref_cnt", -1), "negative ref count"),
        (lambda p: setattr(p.blocks[1], "block_hash", key(5)), "missing from the cache map"),
        (lambda p: p.free_queue.remove(p.blocks[2]), "not free with ref count 0"),
        (lambda p: setattr(p.free_queue, "_len", 2), "free count differs"),
        (lambda p: setattr(p.blocks[0], "ref_cnt", 1), "null block was used"),
    ],
)
def test_check_integrity_catches_corruption(corrupt: object, message: str) -> None:
    pool = BlockPool(4, enable_caching=True)
    pool.free(pool.allocate(3))  # every block made
    pool.check_integrity()
    corrupt(pool)  # type: ignore[operator]
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_check_integrity_catches_a_stale_map_entry() -> None:
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_block(a, key(1))
    a.block_hash = None
    with pytest.raises(AssertionError, match="stale"):
        pool.check_integrity()
