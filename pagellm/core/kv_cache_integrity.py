"""Core stage: the invariants of the KV cache manager's pools and block tables.

Tests call them after every step (through KVCacheManager.check_integrity, itself called by
the scheduler's check); a violation is a bug, never a user error. The check is handed the
manager's pools and tables, so it reads nothing the manager does not pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

from pagellm.core.block_pool import NULL_BLOCK_ID, BlockPool
from pagellm.core.kv_tier import TierIndex
from pagellm.request import Request


def check_kv_cache_integrity(
    *,
    device_pool: BlockPool,
    host_pool: BlockPool,
    device_tables: Mapping[str, list[list[int]]],  # per request on device: a table per group
    host_tables: Mapping[str, list[list[int]]],  # per swapped-out request: its live host blocks per group
    num_groups: int,
    passed_blocks: Callable[[int, int], int],  # (group, computed tokens) -> blocks its window has passed
    block_size: int | None,  # with prefix caching; None: no cached contents to check
    copy_on_write: Collection[str],  # forked requests whose shared last block is not copied yet
    tier: TierIndex | None,
    requests: Iterable[Request] = (),
) -> None:
    """Raise AssertionError unless pools and tables agree on every reference.

    For the given requests (those on device), also check that every cached block in
    their tables holds exactly the content of that position of the request, and that
    each sliding group holds exactly the blocks its window still reads: none freed
    too early, none kept too long.
    """
    for pool, tables_by_request in ((device_pool, device_tables), (host_pool, host_tables)):
        pool.check_integrity()
        refs: Counter[int] = Counter()
        for request_id, tables in tables_by_request.items():
            assert len(tables) == num_groups, f"{request_id} has {len(tables)} tables"
            assert len({len(table) for table in tables}) <= 1 or pool is host_pool, (
                f"{request_id}'s tables differ in length"
            )
            # Host tables hold live blocks only (host block 0 is an ordinary block).
            null = NULL_BLOCK_ID if pool is device_pool else -1
            held = [block_id for table in tables for block_id in table if block_id != null]
            assert len(set(held)) == len(held), f"{request_id} holds a block twice"
            refs.update(held)
        unmade = [block_id for block_id in refs if block_id >= len(pool.blocks)]
        assert not unmade, f"tables hold blocks never allocated: {sorted(unmade)[:8]}"
        for block in pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block} has ref count {block.ref_cnt} but {refs.get(block.block_id, 0)} tables hold it"
            )
    if tier is not None:
        tier.check_integrity()
    both = device_tables.keys() & host_tables.keys()
    assert not both, f"requests on device and host at once: {sorted(both)}"
    for request in requests:
        tables = device_tables.get(request.request_id, [])
        for group, table in enumerate(tables):
            num_null = next((i for i, block_id in enumerate(table) if block_id != NULL_BLOCK_ID), len(table))
            assert NULL_BLOCK_ID not in table[num_null:], f"{request} has a NULL entry after live blocks"
            expected = min(passed_blocks(group, request.num_computed_tokens), len(table))
            assert num_null == expected, (
                f"{request} group {group} has {num_null} blocks freed, its window has passed {expected}"
            )
        if block_size is None:
            continue
        hashes = request.get_block_hashes(block_size)
        for group, table in enumerate(tables):
            for index, block_id in enumerate(table):
                if block_id == NULL_BLOCK_ID:
                    continue
                block = device_pool.blocks[block_id]
                # A forked request's shared last block, not copied yet, holds the
                # parent's tokens after the prompt: the copy comes before any write.
                pending_copy = request.request_id in copy_on_write and index == len(table) - 1
                if block.block_hash is not None and not pending_copy:
                    assert index < len(hashes) and block.block_hash == hashes[index], (
                        f"{request} shares block {block_id} holding other tokens"
                    )
                    assert block.cache_group == group, f"{request} holds group {block.cache_group}'s block {block_id}"
