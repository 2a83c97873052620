"""Core stage: scheduler <-> runner contract (between scheduling and execution stages).

Plain dataclasses of ints and lists, never tensors, so that a runner could live in
another process. How a runner reads a SchedulerOutput, in this order:

1. Drop the state of every request in `finished_req_ids` and `preempted_req_ids`.
2. Copy `blocks_to_offload` and `states_to_offload` out (to the prefix cache's tier), then `blocks_to_swap_out`
   (device -> host), then `blocks_to_copy` (device -> device,
   copy-on-write of forked requests), then `blocks_to_swap_in` (host -> device), all
   before the forward pass. (A block swapped out may be reused as a copy target in the
   same step, so swap-outs go first.)
3. Add `scheduled_new_reqs` (first scheduling, or resumption after any preemption; the
   runner's token list is prompt_token_ids + output_token_ids and the block table is
   complete). For `scheduled_cached_reqs`, append `new_block_ids` to the tables it kept.
   Block ids come as one table per KV cache group (config/kv_layout.py). A table entry
   that a sliding window freed later is not announced: the runner's copy keeps the old
   id, which that group's attention never reads again.
4. Run `num_scheduled_tokens[req_id]` tokens of each request, starting at position
   `num_computed_tokens`; a request in `decode_steps` runs them one at a time, each
   the token sampled after the previous one.
5. A request needs a sampled token iff num_computed_tokens + num_scheduled_tokens
   reaches the number of tokens the runner knows for it (prompt + outputs, the runner
   appending every token it samples). Otherwise it is in a partial prefill chunk and
   gets an empty list in ModelRunnerOutput.sampled_token_ids. An embedding request
   (`pooling_params`) is never sampled: when its prompt is complete the runner reports
   its embedding in ModelRunnerOutput.pooled instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagellm.core.kv_tier import TierReport
from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.request import FinishReason
from pagellm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything a runner needs about a request it holds no state for."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # the full device block tables, one per KV cache group
    num_computed_tokens: int  # KV already in the cache (prefix hit or swapped back in)
    # The sampler needs EOS ids to hold them back before min_tokens outputs.
    eos_token_ids: frozenset[int] = frozenset()
    # n > 1 and not forked yet: the runner samples 1 + num_pending_forks tokens from the
    # prompt's last logits (one per completion) and reports the extra ones as forks.
    num_pending_forks: int = 0
    # An embedding request: the runner pools its prompt's hidden states (no sampling).
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    # A hybrid model: the row of the recurrent state the request owns (computed from zeros
    # when num_computed_tokens is 0; a forked completion's is a copy: state_copies).
    state_slot: int | None = None


@dataclass
class CachedRequestData:
    """A request the runner already holds, scheduled again: only what changed."""

    req_id: str
    new_block_ids: list[list[int]]  # per KV cache group, appended to its table this step (often empty)
    num_computed_tokens: int
    # The tables' length before new_block_ids: shorter than the runner's copy when blocks
    # were freed since (the rejected positions of a speculative verification).
    num_kept_block_ids: int | None = None


class StateSwaps(NamedTuple):
    """A hybrid model's recurrent-state copies of the swaps decided in a step: (device
    slot, host slot) of each request swapped out, (host slot, device slot) of each back in."""

    out: list[tuple[int, int]]
    into: list[tuple[int, int]]


@dataclass
class SchedulerOutput:
    """What to run in one step."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute this step per scheduled request; insertion order is the batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests finished since the previous step (stopped, length, aborted).
    finished_req_ids: set[str] = field(default_factory=set)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    # Speculative decoding: per request, the proposed tokens computed after its next one
    # (they are part of its num_scheduled_tokens); the runner verifies them. With a draft
    # model they are DRAFT_PLACEHOLDER: the runner's draft fills them in.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Multi-step decoding (core/multi_step.py): per decoding request given k > 1 positions
    # (its num_scheduled_tokens), k: the runner computes its last token, samples the next
    # and feeds it back, k times, and returns the k sampled tokens.
    decode_steps: dict[str, int] = field(default_factory=dict)
    # The prefix cache's second tier (core/kv_tier.py), by 16-byte digest: device blocks
    # to write there (copied before anything else of the step, since the block may be
    # reused by it), entries to delete (before those writes), and blocks to load from it
    # into device blocks no scheduled request reads this step (done when the step returns).
    blocks_to_offload: list[tuple[bytes, int]] = field(default_factory=list)
    tier_deletions: list[bytes] = field(default_factory=list)
    blocks_to_load: list[tuple[bytes, int]] = field(default_factory=list)
    # ... and a hybrid's snapshots, by tier key (core/kv_tier.state_key): (key, snapshot
    # slot) to write there (copied before the forward pass takes new snapshots), and (key,
    # state slot) to load into the slot of a request admitted to load (done when the step returns).
    states_to_offload: list[tuple[bytes, int]] = field(default_factory=list)
    states_to_load: list[tuple[bytes, int]] = field(default_factory=list)
    # A hybrid model: (source, target) recurrent-state slots to copy before the step's
    # forward (a forked completion starts from its parent's state).
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # ... and with prefix caching: (snapshot, state slot) copies for the requests admitted on
    # a hit (before the forward), and per request the snapshots to write during the step,
    # as (tokens of the request's step before it, snapshot slot).
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # Swap preemption of a hybrid: the states of the requests swapped out (device slot ->
    # host slot), copied before anything else, and of those swapped in (host -> device),
    # after the forks' copies.
    state_swaps: StateSwaps = field(default_factory=lambda: StateSwaps([], []))

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing to execute (the runner may still need to drop finished state)."""
        return (
            not self.num_scheduled_tokens
            and not self.blocks_to_swap_out
            and not self.blocks_to_swap_in
            and not self.blocks_to_copy
            and not self.blocks_to_offload
            and not self.tier_deletions
            and not self.blocks_to_load
            and not self.states_to_offload
            and not self.states_to_load
            and not self.state_copies
            and not self.state_restores
        )


class TokenLogprobs(NamedTuple):
    """Log-probabilities at one position: the chosen token first, then the top-k.

    `ranks[i]` is the 1-based rank of `token_ids[i]` in that position's distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """What the runner produced in one step."""

    req_ids: list[str]
    # Empty list for a request in a partial prefill chunk.
    sampled_token_ids: dict[str, list[int]]
    # Per request id (forked children included): one entry per sampled token.
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    # Per request id: entries for the prompt positions computed this step (position 0
    # has none, so the first chunk starts at position 1).
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    # Parent id -> first tokens of completions 1..n-1, sampled from the same logits as
    # the parent's own first token.
    forked_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding with a draft model: the tokens the draft proposed (and the
    # runner verified) in place of the scheduled placeholders.
    drafted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Seconds this step spent filling and applying structured-output masks.
    mask_seconds: float = 0.0
    # Embedding requests whose prompt this step completed: the pooled (and, as asked,
    # shortened and normalised) embedding.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # What the runner did for the prefix cache's tier this step (None: no tier).
    kv_tier: TierReport | None = None
    # LoRA adapters copied into a slot this step, and taken out of one for another.
    num_lora_loads: int = 0
    num_lora_evictions: int = 0


# A proposed position whose token the runner's draft model decides.
DRAFT_PLACEHOLDER = -1


@dataclass
class RequestProgress:
    """One request's news from a step: tokens appended, and whether it finished."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: int | None  # the stop_token_ids entry that stopped it; None for EOS

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
