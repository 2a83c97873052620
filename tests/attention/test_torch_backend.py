"""Paged attention: the block table decides where K/V lives, never what attention computes."""

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4


def dense_causal_attention(q, k, v, scale):
    """Plain causal attention over one whole sequence (the independent reference)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    scores.masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_in_chunks(seq_lens, chunk_splits, tables, num_blocks, seed=0):
    """Compute attention for several sequences fed in chunks through the paged cache."""
    gen = torch.Generator().manual_seed(seed)
    qkv = [
        (
            torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen),
            torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen),
            torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen),
        )
        for n in seq_lens
    ]
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    backend = TorchAttentionBackend()
    outputs = [[] for _ in seq_lens]
    done = [0] * len(seq_lens)
    for step_chunks in chunk_splits:  # one step: tokens per sequence (0 = not scheduled)
        qs, ks, vs, slots, starts, lens, rows, owners = [], [], [], [], [0], [], [], []
        for i, count in enumerate(step_chunks):
            if count == 0:
                continue
            q, k, v = qkv[i]
            lo, hi = done[i], done[i] + count
            qs.append(q[lo:hi]), ks.append(k[lo:hi]), vs.append(v[lo:hi])
            slots += [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(lo, hi)]
            starts.append(starts[-1] + count)
            lens.append(hi)
            rows.append(tables[i])
            owners.append(i)
            done[i] = hi
        width = max(map(len, rows))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor([r + [0] * (width - len(r)) for r in rows]),
            query_start_loc=starts,
            seq_lens=lens,
        )
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, HEAD_DIM**-0.5)
        for j, i in enumerate(owners):
            outputs[i].append(out[starts[j] : starts[j + 1]])
    return [torch.cat(o) for o in outputs], qkv


def test_scattered_blocks_equal_contiguous_blocks_and_dense_reference():
    seq_lens = [11, 6, 9]
    steps = [[5, 6, 1], [3, 0, 4], [1, 0, 2], [1, 0, 1], [1, 0, 1]]  # prefill chunks + decodes
    contiguous = [[1, 2, 3], [4, 5], [6, 7, 8]]
    scattered = [[17, 3, 9], [12, 1], [5, 20, 14]]
    out_contiguous, qkv = run_in_chunks(seq_lens, steps, contiguous, num_blocks=9)
    out_scattered, _ = run_in_chunks(seq_lens, steps, scattered, num_blocks=21)
    for a, b, (q, k, v) in zip(out_contiguous, out_scattered, qkv):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, dense_causal_attention(q, k, v, HEAD_DIM**-0.5))


def test_one_step_whole_prefill_equals_token_by_token():
    whole, qkv = run_in_chunks([10], [[10]], [[3, 1, 2]], num_blocks=4)
    stepwise, _ = run_in_chunks([10], [[1]] * 10, [[3, 1, 2]], num_blocks=4)
    torch.testing.assert_close(whole[0], stepwise[0])
