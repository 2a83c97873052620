"""Core stage: one step's work (its batch) as the cost models and the metrics see it.

A step computes, for every scheduled request, `num_tokens` new tokens on top of the
`context` tokens whose KV is already cached. A request computing exactly one token is
a decode (a one-token prefill chunk costs the same: one query row over its context);
anything longer is a prefill chunk (a prompt, or a prompt plus outputs recomputed after
a preemption), or a speculative verification: a decode's next token plus its k proposed
ones. A verification costs what a (k + 1)-token chunk over the same context costs: its
positions go through the weights with the step's other tokens (weights read once per
step), attend causally, and read the context once, as the engine's multi-row attention
path does; unlike a chunk, all k + 1 rows go through the LM head (each is checked).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.request import Request


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The work of one forward pass."""

    # Per prefill chunk: tokens computed this step, and tokens already in the KV cache.
    prefill_num_tokens: tuple[int, ...] = ()
    prefill_context_lens: tuple[int, ...] = ()
    # Per decode: tokens already in the KV cache (the new token attends to these + itself).
    decode_context_lens: tuple[int, ...] = ()
    # Rows whose logits are computed: decodes, prefill chunks that reach the end of their
    # request's tokens (a partial chunk samples nothing), every position of a verification.
    num_sampled_tokens: int = 0
    # KV tokens copied between host and device before the forward pass (swap preemption:
    # whole blocks, so a multiple of the block size).
    num_swapped_tokens: int = 0

    def __post_init__(self) -> None:
        assert len(self.prefill_num_tokens) == len(self.prefill_context_lens)

    @classmethod
    def from_lengths(cls, query_lens: list[int], seq_lens: list[int], num_sampled_tokens: int) -> StepBatch:
        """query_lens[i] new tokens end request i's context of seq_lens[i] tokens."""
        prefills = [(q, s - q) for q, s in zip(query_lens, seq_lens, strict=True) if q != 1]
        decodes = tuple(s - 1 for q, s in zip(query_lens, seq_lens, strict=True) if q == 1)
        return cls(tuple(q for q, _ in prefills), tuple(c for _, c in prefills), decodes, num_sampled_tokens)

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_num_tokens)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.prefill_num_tokens) + len(self.decode_context_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.prefill_num_tokens) + len(self.decode_context_lens)

    @property
    def decode_context_sum(self) -> int:
        """KV tokens the decodes read."""
        return sum(self.decode_context_lens)

    @property
    def prefill_context_sum(self) -> int:
        """Cached KV tokens the prefill chunks read (prefix hits, earlier chunks)."""
        return sum(self.prefill_context_lens)

    @property
    def prefill_attention_pairs(self) -> int:
        """(query, key) pairs of the prefill chunks: causal inside the chunk, full over
        the cached context. Token i of a q-token chunk over c cached tokens attends to
        c + i + 1 positions, so a chunk has q*c + q*(q+1)/2 pairs."""
        return sum(
            q * c + q * (q + 1) // 2
            for q, c in zip(self.prefill_num_tokens, self.prefill_context_lens)
        )

    @property
    def decode_attention_pairs(self) -> int:
        """(query, key) pairs of the decodes: each reads its context plus itself."""
        return sum(self.decode_context_lens) + len(self.decode_context_lens)

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs the whole step scores (every layer attending over all)."""
        return self.prefill_attention_pairs + self.decode_attention_pairs

    @property
    def context_tokens(self) -> int:
        """Tokens whose K/V the step reads: each request's context and its new tokens."""
        return self.prefill_context_sum + self.decode_context_sum + self.num_tokens

    def attention_pairs_within(self, window: int | None) -> int:
        """(query, key) pairs of the whole step in a layer that attends over `window`
        positions at most (None: the whole context)."""
        if window is None:
            return self.prefill_attention_pairs + self.decode_attention_pairs
        chunks = zip(self.prefill_num_tokens, self.prefill_context_lens)
        return sum(_keys_within(c + 1, c + q, window) for q, c in chunks) + sum(
            min(c + 1, window) for c in self.decode_context_lens
        )

    def context_read_within(self, window: int | None) -> int:
        """Cached KV tokens the step reads in a layer of that window (each request's
        first query sees at most window - 1 cached positions)."""
        if window is None:
            return self.prefill_context_sum + self.decode_context_sum
        return sum(min(c, window - 1) for c in self.prefill_context_lens + self.decode_context_lens)


def _keys_within(first: int, last: int, window: int) -> int:
    """sum of min(k, window) for k = first .. last: the keys of a chunk's queries, the
    i-th of which sees first + i positions."""
    if last <= window:
        return (first + last) * (last - first + 1) // 2
    if first >= window:
        return (last - first + 1) * window
    return (first + window) * (window - first + 1) // 2 + (last - window) * window


def batch_from_schedule(
    scheduler_output: SchedulerOutput,
    requests: Mapping[str, Request],
    block_size: int,
    sampled_req_ids: list[str] | None = None,
) -> StepBatch:
    """The StepBatch of a SchedulerOutput, read before update_from_output advances the
    requests (num_computed_tokens is then still the context the runner was told).

    If `sampled_req_ids` is given, the ids of the requests that sample a token this step
    are appended to it (the simulator's fake runner needs them; one pass serves both).
    """
    prefill_tokens: list[int] = []
    prefill_contexts: list[int] = []
    decode_contexts: list[int] = []
    num_sampled = 0
    proposals = scheduler_output.scheduled_spec_decode_tokens
    for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        request = requests[request_id]
        context = request.num_computed_tokens
        if num_tokens == 1:
            decode_contexts.append(context)
        else:
            prefill_tokens.append(num_tokens)
            prefill_contexts.append(context)
        if context + num_tokens >= request.num_tokens:
            num_sampled += num_tokens if request_id in proposals else 1
            if sampled_req_ids is not None:
                sampled_req_ids.append(request_id)
    return StepBatch(
        tuple(prefill_tokens),
        tuple(prefill_contexts),
        tuple(decode_contexts),
        num_sampled,
        block_size
        * (len(scheduler_output.blocks_to_swap_in) + len(scheduler_output.blocks_to_swap_out)),
    )
