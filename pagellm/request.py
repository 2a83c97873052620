"""Request state (engine stage): one generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

# Parent value of the first block of every chain. Any constant works; Python's hash of
# ints and tuples of ints does not depend on PYTHONHASHSEED, so values are reproducible.
_ROOT_HASH_VALUE = 0x5A6E11


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = enum.auto()  # new, or preempted by recompute: needs admission
    RUNNING = enum.auto()  # holds device blocks and is scheduled step by step
    SWAPPED = enum.auto()  # preempted by swap: its KV lives in host blocks
    FINISHED_STOPPED = enum.auto()  # stop token or EOS
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # cancelled from outside

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The user-facing reason of a finished status; None while unfinished."""
        return _FINISH_REASONS.get(self)


class FinishReason(str, enum.Enum):
    """Why a request stopped, as the OpenAI API spells it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


def child_request_id(parent_request_id: str, completion_index: int) -> str:
    """Scheduler id of completion `completion_index` (>= 1) of an n > 1 request."""
    return f"{parent_request_id}#{completion_index}"


class BlockHash:
    """Prefix-cache key of one full block: its token ids and, recursively, its parent's.

    `value` (a 64-bit hash of parent value and token ids) only picks the dict bucket.
    Equality walks the whole chain comparing token ids, so two different prefixes can
    never be confused even if their 64-bit values collide. The walk stops at the first
    node both chains share (identity), which keeps it O(1) when chains are canonical:
    the KV cache manager re-parents a request's chain onto the cached keys it hits, see
    `Request.adopt_cached_block_hash`.
    """

    __slots__ = ("value", "parent", "token_ids", "digest")

    def __init__(self, parent: BlockHash | None, token_ids: tuple[int, ...]) -> None:
        self.parent = parent
        self.token_ids = token_ids
        # The prefix-cache tier's persistent key (core/kv_tier.py), computed on first use.
        self.digest: bytes | None = None
        parent_value = _ROOT_HASH_VALUE if parent is None else parent.value
        self.value: int = hash((parent_value, token_ids))

    def __hash__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockHash):
            return NotImplemented
        a: BlockHash | None = self
        b: BlockHash | None = other
        # Iterative on purpose: chains of thousands of blocks would overflow recursion.
        while a is not b:
            if a is None or b is None or a.value != b.value or a.token_ids != b.token_ids:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockHash({self.value:#x}, {len(self.token_ids)} tokens)"


class Request:
    """Mutable state of one request, owned by the scheduler once added.

    `max_tokens` is the resolved limit of new tokens: the caller may pass it, otherwise
    `sampling_params.max_tokens` is used, and if that is None too the scheduler resolves
    it to max_model_len - prompt length when the request is added.
    `num_computed_tokens` counts tokens whose KV is written in the cache (advanced by the
    scheduler in update_from_output; reset to 0 by a recompute preemption).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: Iterable[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        background: bool = False,
        max_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        # The adapter it runs under: part of its blocks' prefix-cache keys, so that a block
        # computed under one adapter (or none) is never a hit for another.
        self.lora_request = lora_request
        # An embedding request (pooling_params resolved, pooling_type set): its prompt is
        # computed, then pooled instead of sampled, and it finishes with no output token.
        self.pooling_params = pooling_params
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.arrival_time: float = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # Background work (a batch line): served only where the other requests leave room,
        # first to be preempted, under every scheduling policy.
        self.background = background
        self.max_tokens: int | None = (
            sampling_params.max_tokens if max_tokens is None else max_tokens
        )
        if pooling_params is not None:
            self.max_tokens = 0

        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        # Prefix-cache hit tokens when first admitted (later re-admissions don't count),
        # those of them loaded from the prefix cache's second tier (core/kv_tier.py)
        # included.
        self.num_cached_tokens = 0
        self.num_tier_tokens = 0

        # Parallel sampling (n > 1): this request is completion 0 and, once its prompt is
        # computed, forks n - 1 siblings that share the prompt's KV blocks.
        self.num_pending_forks = sampling_params.n - 1
        self.parent_request_id: str | None = None
        self.completion_index = 0

        # Prompt + outputs in one list so block hashing can slice it cheaply.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self._block_hashes: list[BlockHash] = []
        self._hash_block_size: int | None = None
        # The parent of the first block's key: none for the base model, a node naming the
        # adapter (a "token" no vocabulary has) otherwise.
        self._hash_root = None if lora_request is None else BlockHash(None, (-1, lora_request.lora_int_id))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids. A live view: read it, never mutate it."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)

    def get_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of every full block of the request's tokens so far.

        Computed lazily and incrementally; the returned list is the request's own (the
        KV cache manager indexes it by block position in the block table).
        """
        if self._hash_block_size != block_size:
            self._block_hashes = []
            self._hash_block_size = block_size
        hashes = self._block_hashes
        tokens = self._all_token_ids
        for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
            parent = hashes[-1] if hashes else self._hash_root
            hashes.append(BlockHash(parent, tuple(tokens[start : start + block_size])))
        return hashes

    def adopt_cached_block_hash(self, index: int, cached: BlockHash) -> None:
        """Replace block `index`'s hash by the equal key found in the prefix cache.

        Pointing the next block's parent at the cached key keeps later equality checks
        O(1) (they stop at the shared node). Content, hence equality and value, is
        unchanged, so this is safe even for keys already stored in the cache map.
        """
        hashes = self._block_hashes
        assert hashes[index] == cached, "adopting a key with different content"
        hashes[index] = cached
        if index + 1 < len(hashes):
            hashes[index + 1].parent = cached
