"""Dense float64 attention over a paged cache, masked by hand: the reference the attention
backends' tests compare against (sliding windows and soft-capping included)."""

from __future__ import annotations

import torch


def dense_attention(q, cache, metadata, scale, window=None, softcap=None, sinks=None):  # noqa: ANN001, ANN201
    """Each query row over its request's positions read through the block table: a query
    at position p sees p - window + 1 .. p (all of 0 .. p without a window), each scaled
    score s capped to softcap * tanh(s / softcap) where a cap is given; with `sinks`
    ([heads]), head h's softmax has sinks[h] as one more logit, dropped after."""
    block_size = cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.shape[3]
    for r, seq_len in enumerate(metadata.seq_lens):
        start, end = metadata.query_start_loc[r], metadata.query_start_loc[r + 1]
        table = metadata.block_tables[r].tolist()
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        keys = cache[0].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [seq, heads, dim]
        values = cache[1].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        for row in range(start, end):
            position = seq_len - (end - row)
            first = 0 if window is None else max(0, position - window + 1)
            scores = torch.einsum("hd,khd->hk", q[row].double(), keys[first : position + 1]) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is None:
                probs = scores.softmax(-1)
            else:
                probs = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(-1)[:, :-1]
            out[row] = torch.einsum("hk,khd->hd", probs, values[first : position + 1])
    return out
