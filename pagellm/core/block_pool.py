"""Core stage: KV block pool: blocks, ref counts, LRU free queue, prefix-cache map.

A pool owns `num_blocks` fixed-size blocks identified by their index. The device pool
reserves block 0 as a null block that is never handed out (a runner may point padding
slots at it), so it has num_blocks - 1 usable blocks. The host (swap) pool uses the same
class without the null block and without prefix caching.

Free blocks wait in a queue in eviction order: allocation takes from the head. A freed
block keeps its prefix-cache hash, so it can still be hit until it is reused; the hash
is dropped lazily, at the moment the block is taken for a new allocation (eviction).

A block's bookkeeping object is made the first time the block is allocated: until then
the never-used blocks wait in the queue as one range of ids. A small model's default CPU
budget holds a million blocks, whose objects took seconds to make at every start and
hundreds of MB to keep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from pagellm.request import BlockHash

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0


class KVBlock:
    """One block's bookkeeping; the KV tensors themselves live in the runner."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "cache_group", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix-cache map (full and computed),
        # with the KV cache group whose layers' K/V it holds (the same tokens' blocks of
        # two groups hold different layers).
        self.block_hash: BlockHash | None = None
        self.cache_group = 0
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = " cached" if self.block_hash is not None else ""
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, push at both ends and removal.

    Removal from the middle is what a prefix hit on a free cached block needs, which is
    why this is not a deque.

    `num_unused` blocks never used yet may wait as one range, made by `make_unused` (in
    id order) only when popped. The range keeps the place all blocks had in the new
    queue: blocks queued at the head come before it, blocks queued at the tail after it,
    so the order is the one a queue of every block made up front would have.
    """

    def __init__(self, num_unused: int = 0, make_unused: Callable[[], KVBlock] | None = None) -> None:
        if num_unused and make_unused is None:
            raise ValueError("never-used blocks need a way to make them")
        # Sentinels so that no operation has to special-case an empty list.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self._num_unused = num_unused
        self._make_unused = make_unused
        # Stands in the list for the range while any of it is left.
        self._unused_range = KVBlock(-1)
        if num_unused:
            self._link_after(self._head, self._unused_range)  # not counted: __len__ adds the range

    def __len__(self) -> int:
        return self._len + self._num_unused

    @property
    def num_unused(self) -> int:
        """Blocks in the queue never used yet (and not made yet)."""
        return self._num_unused

    def _nodes(self) -> Iterator[KVBlock]:
        """The list's nodes in order, the never-used range's stand-in included."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def __iter__(self) -> Iterator[KVBlock]:
        """The queued blocks made so far, in order (not the never-used range)."""
        return (node for node in self._nodes() if node is not self._unused_range)

    def ids(self, first_unused_id: int) -> list[int]:
        """Every queued block's id in order, the never-used range as the ids from
        `first_unused_id` on."""
        result: list[int] = []
        for node in self._nodes():
            if node is self._unused_range:
                result.extend(range(first_unused_id, first_unused_id + self._num_unused))
            else:
                result.append(node.block_id)
        return result

    def _link_after(self, anchor: KVBlock, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        successor = anchor.next_free
        assert successor is not None
        block.prev_free, block.next_free = anchor, successor
        anchor.next_free = block
        successor.prev_free = block

    def _unlink(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None

    def append(self, block: KVBlock) -> None:
        """Queue at the tail: evicted last."""
        prev = self._tail.prev_free
        assert prev is not None
        self._link_after(prev, block)
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        """Queue at the head: reused first."""
        self._link_after(self._head, block)
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        self._unlink(block)
        self._len -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("pop from an empty free block queue")
        if block is self._unused_range:
            assert self._make_unused is not None
            self._num_unused -= 1
            if not self._num_unused:
                self._unlink(block)
            return self._make_unused()
        self.remove(block)
        return block

    def is_queued(self, block: KVBlock) -> bool:
        return block.prev_free is not None


class BlockPool:
    """Blocks with ref counts, the free queue and the block-hash -> block map."""

    def __init__(
        self, num_blocks: int, *, enable_caching: bool, reserve_null_block: bool = True
    ) -> None:
        first_usable = 1 if reserve_null_block else 0
        if num_blocks < first_usable:
            raise ValueError(
                f"a block pool needs at least {first_usable} block(s), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._first_usable = first_usable
        # The blocks made so far, by id: every block ever allocated is here (ids are
        # handed out in order until each block has been used once).
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(first_usable)]
        self.null_block: KVBlock | None = (
            self.blocks[NULL_BLOCK_ID] if reserve_null_block else None
        )
        self.free_queue = FreeBlockQueue(num_blocks - first_usable, self._make_block)
        self.cached_blocks: dict[tuple[int, BlockHash], KVBlock] = {}
        self.num_evictions = 0
        # Called with the ids of blocks whose cached content is dropped (event log).
        self.on_evict: Callable[[list[int]], None] | None = None
        # Told each hash the cache forgets (a hybrid's state snapshot goes with its block).
        self.on_forget: Callable[[BlockHash], None] | None = None

    def _make_block(self) -> KVBlock:
        block = KVBlock(len(self.blocks))
        self.blocks.append(block)
        return block

    def free_block_ids(self) -> list[int]:
        """The free blocks' ids in the order allocation takes them (never-used ones too)."""
        return self.free_queue.ids(len(self.blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self._first_usable

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-free ones included."""
        return len(self.free_queue)

    def get_usage(self) -> float:
        """Fraction of usable blocks referenced by some request."""
        if not self.num_usable_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self.cached_blocks.get((group, block_hash))

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, ref count 1 each.

        The caller checks `num_free_blocks` first; asking for more is a bug.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {self.num_free_blocks} free"
            )
        allocated = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def _evict(self, block: KVBlock) -> None:
        """Forget a reused block's cached content (the lazy half of eviction)."""
        if block.block_hash is None:
            return
        removed = self.cached_blocks.pop((block.cache_group, block.block_hash), None)
        assert removed is block, "a hashed block must be the one its hash maps to"
        if self.on_forget is not None:
            self.on_forget(block.block_hash)
        block.block_hash = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict([block.block_id])

    def forget(self, block: KVBlock) -> None:
        """Drop the cached content of a block its one holder is about to overwrite."""
        assert block.ref_cnt == 1, "only a block no one else holds may change content"
        self._evict(block)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order.

        A block that reaches zero is queued: at the tail if it holds cached content
        (evicted last, LRU), at the head if it holds nothing reusable (reused first, so
        that no cached block is evicted while worthless blocks are free).
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            assert block is not self.null_block, "the null block is never allocated"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group: int = 0) -> bool:
        """Register a full, computed block of KV cache group `group` under its hash.

        Returns False (and leaves the block uncached) when caching is off or another
        block already holds the same content: two requests with the same prefix that
        were admitted together compute duplicate blocks, and one copy is enough.
        """
        if not self.enable_caching:
            return False
        assert block.ref_cnt > 0, "only a block in use can be registered"
        if block.block_hash is not None:
            assert block.block_hash == block_hash and block.cache_group == group, "block re-registered with other content"
            return False
        if (group, block_hash) in self.cached_blocks:
            return False
        block.block_hash = block_hash
        block.cache_group = group
        self.cached_blocks[group, block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget the content of every free cached block (e.g. between benchmark runs).

        Blocks in use keep their hash: their content stays valid. The dropped blocks, now
        holding nothing reusable, move to the head of the queue as free() would have put
        them, so that they are reused before blocks never used yet: on a CPU the cache's
        pages become resident as blocks are first written, and a second run over the same
        amount of context would otherwise touch a fresh set (the resident KV cache doubling
        with every benchmark repeat). Returns how many were dropped.
        """
        dropped: list[KVBlock] = []
        for block in self.free_queue:
            if block.block_hash is not None:
                dropped.append(block)
        for block in dropped:
            del self.cached_blocks[block.cache_group, block.block_hash]
            if self.on_forget is not None:
                self.on_forget(block.block_hash)
            block.block_hash = None
            if self.on_evict is not None:
                self.on_evict([block.block_id])
            self.free_queue.remove(block)
        # Most recently freed first: their pages are the likeliest still in the CPU's caches.
        for block in dropped:
            self.free_queue.appendleft(block)
        return len(dropped)

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping contradicts itself."""
        queued = list(self.free_queue)
        unused = self.free_queue.num_unused
        assert len(queued) + unused == len(self.free_queue), "free count differs from queue length"
        assert len(self.blocks) + unused == self.num_blocks, (
            f"{len(self.blocks)} blocks made and {unused} never used, of {self.num_blocks}"
        )
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued), "a block is queued twice"
        if self.null_block is not None:
            nb = self.null_block
            assert nb.ref_cnt == 0 and nb.block_hash is None, "null block was used"
            assert not self.free_queue.is_queued(nb), "null block is in the free queue"
        for block in self.blocks[self._first_usable:]:
            assert block.ref_cnt >= 0, f"negative ref count on {block}"
            is_free = block.block_id in queued_ids
            assert is_free == (block.ref_cnt == 0), (
                f"{block} is {'free' if is_free else 'not free'} with ref count {block.ref_cnt}"
            )
            assert is_free == self.free_queue.is_queued(block), f"{block} has stale links"
            if block.block_hash is not None:
                assert self.enable_caching, f"{block} hashed with caching off"
                assert self.cached_blocks.get((block.cache_group, block.block_hash)) is block, (
                    f"{block} has a hash missing from the cache map"
                )
        for (group, block_hash), block in self.cached_blocks.items():
            assert block.block_hash is block_hash and block.cache_group == group, f"map entry of {block} is stale"
