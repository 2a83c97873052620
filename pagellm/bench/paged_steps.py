"""Bench stage: random paged-attention steps, for the GPU check's kernel section and the
attention backends' tests."""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionMetadata


def random_step(gen, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, dtype):
    """A mixed step: request i computes query_lens[i] new tokens ending a context of
    context_lens[i], its blocks scattered over a cache whose other slots hold noise."""
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots, starts = [], [], [0]
    for q_len, ctx in zip(query_lens, context_lens):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
        starts.append(starts[-1] + q_len)
    width = max(map(len, tables))
    num_tokens = starts[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    # Views into one fused projection, as the model hands them over (strided rows).
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc=starts,
        seq_lens=list(context_lens),
    )
    shape = lambda x, heads: x.view(num_tokens, heads, head_dim)
    return shape(q, num_heads), shape(k, num_kv_heads), shape(v, num_kv_heads), cache, metadata
