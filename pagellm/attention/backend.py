"""Attention stage: the interface every attention implementation provides.

A backend writes the step's new K/V into the paged cache (by slot mapping) and computes
causal attention for a flattened batch in which each request reads its whole context
through its block table. The model knows nothing else about the cache layout.
Which backend runs is chosen in selector.py; this module knows none of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention.linear_attention import LinearAttentionMetadata


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flat batch and where its K/V lives.

    Requests appear in the flat batch in order; request r owns rows
    query_start_loc[r] : query_start_loc[r + 1]. Its new tokens are the last
    (query_start_loc[r + 1] - query_start_loc[r]) positions of a context of
    seq_lens[r] tokens, so the causal mask is offset by the tokens computed earlier.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int64
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs] context length including this step's tokens
    # What a backend derives from the rest once per step (every layer reuses it; keyed by
    # sliding window where the plan depends on it).
    backend_plan: Any = None
    # A model with several KV cache groups (config/kv_layout.py): this is group 0's
    # metadata, and group_metadata[g - 1] group g's (its own slots and block tables).
    group_metadata: tuple[AttentionMetadata, ...] = ()
    # A hybrid model: each request's recurrent-state slot and the linear-attention layers'
    # states (attention/linear_attention.py); None for a model whose layers all attend.
    linear: LinearAttentionMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group `group`'s layers."""
        return self if group == 0 else self.group_metadata[group - 1]


class AttentionBackend(ABC):
    """One attention implementation (reference torch, fast CPU, Triton...)."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value in the cache, then attend over each request's context: with a
        sliding window, a query at position p over positions p - sliding_window + 1 .. p
        only (blocks wholly before that may already hold other requests' tokens). With
        `softcap` (Gemma 2), each scaled score s becomes softcap * tanh(s / softcap) before
        the softmax. With `sinks` (gpt-oss), head h's softmax has one more logit, sinks[h],
        in its denominator, which weighs no value row (the weights sum to less than 1)."""
