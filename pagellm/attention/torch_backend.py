"""Attention stage: the reference implementation in plain PyTorch.

Correct for any mix of prefill chunks and decode tokens; each request gathers its K/V
from its blocks and runs scaled dot-product attention with a causal mask that is offset
by the tokens it computed in earlier steps. An fp8 cache (kv_cache_dtype.py) is written
saturated and rounded, and read widened to the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.kv_cache_dtype import as_stored, copyable, to_cache_dtype


def write_kv_to_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """Scatter the new tokens' K/V into their cache slots (fp8: saturated, rounded)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_slots = copyable(kv_cache[0].view(-1, num_kv_heads, head_dim))
    value_slots = copyable(kv_cache[1].view(-1, num_kv_heads, head_dim))
    key_slots.index_copy_(0, slot_mapping, copyable(to_cache_dtype(key, kv_cache.dtype)))
    value_slots.index_copy_(0, slot_mapping, copyable(to_cache_dtype(value, kv_cache.dtype)))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_num_blocks_per_req]
    seq_len: int,
    start: int = 0,
) -> torch.Tensor:  # [seq_len - start, num_kv_heads, head_dim]
    """Positions start .. seq_len - 1 of a request's context (blocks before start's unread)."""
    block_size = cache.shape[1]
    first_block = start // block_size
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[first_block:num_blocks])
    offset = first_block * block_size
    return blocks.flatten(0, 1)[start - offset : seq_len - offset]


@dataclass(frozen=True)
class _DecodeGroup:
    """Decode requests of similar context length, attended together."""

    rows: torch.Tensor  # [num] rows of the flat batch (one query token each)
    tables: torch.Tensor  # [num, num_blocks] the blocks to gather
    padding: torch.Tensor  # [num, num_blocks * block_size] True outside a request's keys


@dataclass(frozen=True)
class _StepPlan:
    decode_groups: list[_DecodeGroup]
    others: list[int]  # requests with more than one query token (prefill chunks)


class TorchAttentionBackend(AttentionBackend):
    """Decode rows (one query token) are batched into masked attention calls over
    their gathered, padded contexts; prefill chunks run one request at a time."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv_to_cache(key, value, kv_cache, metadata.slot_mapping)
        if metadata.backend_plan is None:
            metadata.backend_plan = {}
        plan: _StepPlan | None = metadata.backend_plan.get(("torch", sliding_window))
        if plan is None:
            plan = _plan_step(metadata, kv_cache.shape[2], query.device, sliding_window)
            metadata.backend_plan["torch", sliding_window] = plan
        output = torch.empty_like(query)
        for group in plan.decode_groups:
            self._batched_decode(query, kv_cache, group, scale, output, softcap, sinks)
        for r in plan.others:
            self._one_request(query, key, value, kv_cache, metadata, r, scale, output, sliding_window, softcap, sinks)
        return output

    @staticmethod
    def _one_request(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        r: int,
        scale: float,
        output: torch.Tensor,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        start, end = metadata.query_start_loc[r], metadata.query_start_loc[r + 1]
        seq_len = metadata.seq_lens[r]
        query_len = end - start
        q = query[start:end].transpose(0, 1)  # [heads, tokens, head_dim]
        if sliding_window is not None and seq_len > sliding_window:
            # Keys from the first query's window start on; each query masks its own.
            first_key = max(0, seq_len - query_len - sliding_window + 1)
            k = gather_context(kv_cache[0], metadata.block_tables[r], seq_len, first_key).transpose(0, 1)
            v = gather_context(kv_cache[1], metadata.block_tables[r], seq_len, first_key).transpose(0, 1)
            device = query.device
            q_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
            k_pos = torch.arange(first_key, seq_len, device=device).unsqueeze(0)
            mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
            out = _sdpa(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap=softcap, sinks=sinks)
        elif query_len == seq_len:
            # Nothing cached before this chunk: attend over its own new K/V directly,
            # rounded as the cache holds them (what every later read sees).
            k = as_stored(key[start:end], kv_cache.dtype).transpose(0, 1)
            v = as_stored(value[start:end], kv_cache.dtype).transpose(0, 1)
            out = _sdpa(q, k.to(q.dtype), v.to(q.dtype), None, scale, causal=query_len > 1, softcap=softcap, sinks=sinks)
        else:
            k = gather_context(kv_cache[0], metadata.block_tables[r], seq_len).transpose(0, 1)
            v = gather_context(kv_cache[1], metadata.block_tables[r], seq_len).transpose(0, 1)
            mask = None
            if query_len > 1:
                # Query i sits at context position (seq_len - query_len + i).
                device = query.device
                q_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
                mask = torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos
            out = _sdpa(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap=softcap, sinks=sinks)
        output[start:end] = out.transpose(0, 1)

    @staticmethod
    def _batched_decode(
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
        output: torch.Tensor,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        num, num_blocks = group.tables.shape
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        width = num_blocks * kv_cache.shape[2]
        # [num, kv_heads, width, head_dim]: each request's context, padded to the longest.
        k = kv_cache[0][group.tables].view(num, width, num_kv_heads, head_dim).transpose(1, 2)
        v = kv_cache[1][group.tables].view(num, width, num_kv_heads, head_dim).transpose(1, 2)
        group_size = query.shape[1] // num_kv_heads
        # Two batched matmuls with the query heads grouped under their K/V head: for one
        # query token this is several times faster on CPU than the fused SDPA kernels.
        q = query[group.rows].view(num, num_kv_heads, group_size, head_dim)
        scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).float() * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(group.padding[:, None, None, :], float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1).to(q.dtype)  # [num, kv_heads, group_size, width]
        else:
            probs = _softmax_with_sinks(scores, sinks.view(num_kv_heads, group_size, 1)).to(q.dtype)
        out = torch.matmul(probs, v.to(q.dtype))  # [num, kv_heads, group_size, head_dim]
        output[group.rows] = out.view(num, num_kv_heads * group_size, head_dim)


def _plan_step(
    metadata: AttentionMetadata, block_size: int, device: torch.device, sliding_window: int | None = None
) -> _StepPlan:
    """Split the step's requests into decode groups and prefill chunks (once per step).

    A decode row reads keys first_key .. seq_len - 1: all of them, or its sliding window.
    Its gathered blocks start at first_key's, so blocks before the window are not read.
    """
    starts, seq_lens = metadata.query_start_loc, metadata.seq_lens
    decodes = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] == 1]
    others = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] != 1]
    first_keys = [0 if sliding_window is None else max(0, length - sliding_window) for length in seq_lens]
    first_blocks = [first_key // block_size for first_key in first_keys]
    spans = [seq_lens[r] - first_blocks[r] * block_size for r in range(metadata.num_reqs)]
    groups = []
    for members in _length_groups(decodes, spans):
        num_blocks = -(-max(spans[r] for r in members) // block_size)
        index = torch.tensor(members, device=device)
        first_block = torch.tensor([first_blocks[r] for r in members], device=device).unsqueeze(1)
        columns = (first_block + torch.arange(num_blocks, device=device)).clamp(max=metadata.block_tables.shape[1] - 1)
        # Position of each gathered key, and the request's own key range.
        positions = first_block * block_size + torch.arange(num_blocks * block_size, device=device)
        lengths = torch.tensor([seq_lens[r] for r in members], device=device).unsqueeze(1)
        lowest = torch.tensor([first_keys[r] for r in members], device=device).unsqueeze(1)
        groups.append(
            _DecodeGroup(
                rows=torch.tensor([starts[r] for r in members], device=device),
                tables=metadata.block_tables[index.unsqueeze(1), columns],
                padding=(positions >= lengths) | (positions < lowest),
            )
        )
    return _StepPlan(groups, others)


def _length_groups(decodes: list[int], seq_lens: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Split decode requests into groups of similar context length.

    A group's contexts are gathered padded to its longest one; grouping by length keeps
    the padding (copied and masked for nothing) under `max_waste` of what is gathered.
    """
    ordered = sorted(decodes, key=lambda r: seq_lens[r])
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for r in ordered:
        length = seq_lens[r]
        # Sorted ascending, so `length` would be the group's new maximum.
        if current and 1 - (total + length) / (length * (len(current) + 1)) > max_waste:
            groups.append(current)
            current, total = [], 0
        current.append(r)
        total += length
    if current:
        groups.append(current)
    return groups


def _sdpa(
    q: torch.Tensor,  # [..., heads, q_len, head_dim]
    k: torch.Tensor,  # [..., kv_heads, kv_len, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [heads]
) -> torch.Tensor:
    """Scaled dot-product attention with grouped K/V heads shared by several query heads
    (mask: True where a key is visible)."""
    group = q.shape[-3] // k.shape[-3]
    if softcap is not None or sinks is not None:  # SDPA has neither soft-capping nor sinks: the scores in the open
        return _open_attention(q, k, v, mask, scale, causal, softcap, sinks)
    if group > 1 and _HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=True
        )
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)


def _open_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool,
    softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1) if sinks is None else _softmax_with_sinks(scores, sinks.view(-1, 1, 1))
    return torch.matmul(probs.to(q.dtype), v)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of `scores` (float32) with each row's sink logit as one more
    column, dropped after (its probability goes to no value row); `sinks` is shaped as
    scores' rows with a last axis of 1 ([heads, 1, 1] for [heads, rows, keys]), broadcast."""
    sink_column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]


# enable_gqa arrived in torch 2.5; older builds repeat the K/V heads instead.
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
