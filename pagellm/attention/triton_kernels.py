"""Attention stage: GPU: Triton kernels over the paged KV cache.

Three kernels:

- `store_kv`: scatter the step's new K/V rows into their cache slots (slot < 0 skips a
  row: padding rows of a CUDA-graph batch). An fp8 cache gets the bytes `_fp8_bits`
  computes with integer operations: saturated and rounded to nearest even, the same
  bits as torch's path and the C kernels, on the GPU and under the interpreter alike
  (the interpreter's own float-to-fp8 cast rounds half up and loses the carry of a
  mantissa that rounds over, e.g. 31.4 -> 16, and neither saturates).
- `paged_attention`: causal attention for a mixed batch. A program owns one tile of one
  request's query tokens for one KV head; its rows are (token, query head) pairs of the
  heads that share that KV head (GQA), so each K/V row is loaded once for the whole
  group. It walks the request's context through its block table with an online softmax
  in float32. With NUM_SPLITS > 1 (decode steps with few requests and long contexts,
  flash-decoding) each program covers one slice of the context and writes a partial
  result that `merge_splits` combines.
- `merge_splits`: the log-sum-exp merge of the partial results.

The cache layout is the engine's: per layer [2, num_blocks, block_size, num_kv_heads,
head_dim], contiguous, of the model's dtype or fp8 (read widened to the query's dtype;
every fp8 value is exact in bf16, float16 and float32). Everything here runs under
Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors as well, which is how the CPU
test suite checks it.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite stand-in for -inf as the running max: exp2(-inf - (-inf)) would be NaN for a
# row that has seen no key yet, exp2(-inf - _NEG_BIG) is a clean 0.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634  # host side only


@triton.jit
def _fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr):
    """The fp8 bytes (MANT mantissa bits, exponent bias BIAS) of x: |x| saturated at the
    float32 bits MAX_BITS, rounded to nearest even (csrc/fp8.h fp8_from_float_bits)."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(bits & 0x7FFFFFFF, MAX_BITS)
    e = a >> 23  # float32 biased exponent
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)  # with the implicit bit
    t = e - 127 + BIAS  # fp8 biased exponent
    shift = tl.minimum(23 - MANT + tl.maximum(1 - t, 0), 30)  # one more bit per step below normal
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    rounded = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    # q holds the implicit bit for normal values; a mantissa rounding over carries on.
    exponent = (tl.maximum(t, 1) - 1) << MANT
    return (sign | (exponent + rounded)).to(tl.uint8)


@triton.jit
def store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous (fp8: as uint8)
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MANT: tl.constexpr,  # 0: cast to the cache's type; 3 (e4m3) or 2 (e5m2): fp8 bytes
    FP8_BIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
    target = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    if FP8_MANT == 0:
        tl.store(key_cache_ptr + target, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + target, value.to(value_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(key_cache_ptr + target, _fp8_bits(key, FP8_MANT, FP8_BIAS, FP8_MAX_BITS), mask=mask)
        tl.store(value_cache_ptr + target, _fp8_bits(value, FP8_MANT, FP8_BIAS, FP8_MAX_BITS), mask=mask)


@triton.jit
def paged_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    value_cache_ptr,
    block_tables_ptr,  # [num_reqs, max_blocks] int
    seq_lens_ptr,  # [num_reqs] int32: context length including this step's tokens
    query_start_loc_ptr,  # [num_reqs + 1] int32
    tile_req_ptr,  # [num_tiles] int32: request of each query tile
    tile_start_ptr,  # [num_tiles] int32: first query token of the tile, within its request
    output_ptr,  # [num_tokens, num_heads, head_dim] (NUM_SPLITS == 1)
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32 (NUM_SPLITS > 1)
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    sinks_ptr,  # [num_heads] fp32: each head's sink logit times log2(e) (gpt-oss); read with HAS_SINKS
    query_stride_token,
    query_stride_head,
    output_stride_token,
    output_stride_head,
    block_table_stride,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    window,  # sliding window (a query at p sees keys p - window + 1 .. p); 0: none
    softcap_in,  # soft-capping (Gemma 2): scores become cap * tanh(s / cap), with
    softcap_out,  # scale / cap and cap * log2(e) (scale_log2 unused); read with SOFTCAP
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per tile; BLOCK_M = BLOCK_Q * GROUP padded
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_FP32: tl.constexpr,  # float32 dots in full precision (no TF32)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the interpreter's bf16 dot is wrong)
    # A compile-time switch, not a test of softcap_in in the loop: Triton 3.6's software
    # pipeliner fails on that branch once the key cache's pointer is known aligned (on an
    # H200, every bf16 kernel failed to compile).
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    query_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_before = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    row_token = tile_start + rows // GROUP  # query token within the request
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (row_token < query_len)
    row_position = context_before + row_token  # the token's position in the context
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    flat_row = (query_start + row_token).to(tl.int64)
    q = tl.load(
        query_ptr + flat_row[:, None] * query_stride_token + row_head[:, None] * query_stride_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Keys this tile can see: up to the causal limit of its last token, from the window
    # start of its first (blocks before it are never read: they may be reused).
    last_token = tl.minimum(tile_start + BLOCK_Q, query_len) - 1
    kv_end = tl.minimum(context_before + last_token + 1, seq_len)
    kv_first = 0
    if window > 0:
        kv_first = tl.maximum(context_before + tile_start - window + 1, 0)
    kv_begin = kv_first
    if NUM_SPLITS > 1:
        split_len = tl.cdiv(tl.cdiv(kv_end - kv_first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_begin = kv_first + split * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)

    running_max = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + req.to(tl.int64) * block_table_stride
    kv_row_stride = NUM_KV_HEADS * HEAD_DIM
    for block_start in range(kv_begin, kv_end, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_end
        block_ids = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slots = block_ids * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_offsets = slots[:, None] * kv_row_stride + kv_head * HEAD_DIM + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        # Probabilities are rounded to the query's type (the model's) for the second dot,
        # as on the GPU; fp8 K/V are widened to it (exactly).
        probs_type = query_ptr.dtype.element_ty
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(probs_type)
            v = v.to(probs_type)
        if IEEE_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            # tanh(x) = 2 sigmoid(2x) - 1 (the interpreter and every GPU have sigmoid).
            scores = (2.0 * tl.sigmoid(2.0 * scores * softcap_in) - 1.0) * softcap_out
        else:
            scores = scores * scale_log2
        visible = key_valid[None, :] & (keys[None, :] <= row_position[:, None])
        if window > 0:
            visible = visible & (keys[None, :] > row_position[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None]
        probs = probs.to(probs_type).to(v.dtype)
        if IEEE_FP32:
            acc += tl.dot(probs, v, input_precision="ieee")
        else:
            acc += tl.dot(probs, v)
        running_max = new_max

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink's weight joins the denominator (the splits' merge adds it there)
            sink = tl.load(sinks_ptr + row_head, mask=row_valid, other=0.0)
            running_sum += tl.exp2(sink - running_max)
        out = acc / running_sum[:, None]
        tl.store(
            output_ptr + flat_row[:, None] * output_stride_token + row_head[:, None] * output_stride_head + dims[None, :],
            out.to(output_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # An empty slice leaves max = _NEG_BIG and sum = 0: the merge gives it no weight.
        stat_index = (flat_row * NUM_HEADS + row_head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + stat_index, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + stat_index, running_sum, mask=row_valid)
        tl.store(partial_out_ptr + stat_index[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)


@triton.jit
def merge_splits_kernel(
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32, unnormalized
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 (base-2 scores)
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    output_ptr,  # [num_tokens, num_heads, head_dim]
    rows_ptr,  # [num_rows] int32: tokens to merge
    sinks_ptr,  # [num_heads] fp32 sink logits times log2(e); read with HAS_SINKS
    output_stride_token,
    output_stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    stat_base = (token * NUM_HEADS + head) * NUM_SPLITS
    maxes = tl.load(partial_max_ptr + stat_base + splits)
    sums = tl.load(partial_sum_ptr + stat_base + splits)
    overall = tl.max(maxes, axis=0)
    weights = tl.exp2(maxes - overall)
    total = tl.sum(sums * weights, axis=0)
    if HAS_SINKS:
        total += tl.exp2(tl.load(sinks_ptr + head) - overall)
    partial = tl.load(
        partial_out_ptr + (stat_base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], axis=0) / total
    tl.store(
        output_ptr + token * output_stride_token + head * output_stride_head + dims,
        out.to(output_ptr.dtype.element_ty),
        mask=dim_valid,
    )


LOG2E = _LOG2E
