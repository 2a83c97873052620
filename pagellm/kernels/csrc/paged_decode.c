/* Attention stage, CPU: decode attention read straight from the paged KV cache.
 *
 * One query token per request attends over its whole context, found block by block
 * through its block table: nothing is gathered into a padded copy first, so K and V are
 * read once from where they lie. Query heads that share a K/V head are handled together
 * so each K/V row is loaded once per group. Scores, softmax and sums are float32 whatever
 * the storage type: queries and outputs float32 or bfloat16, the cache the same or an
 * 8-bit float (fp8.h; widened exactly as each row is read).
 *
 * Compiled with -ffast-math: it lets the compiler reorder the float sums and call the
 * vector expf of libmvec; nothing here relies on infinities or NaN (NaN is handled on
 * the integer bits in float_to_bf16).
 *
 * Built at run time by pagellm/kernels/build.py with the machine's C compiler.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "float_mode.h"
#include "fp8.h"
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif


/* head_dim elements of element type `type` (fp8.h ELEM_*) starting `offset` elements
 * into `base`, widened to float32. */
static inline void load_row(const void *base, int64_t offset, int head_dim, int type, float *dst) {
    if (type == ELEM_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) dst[d] = bf16_to_float(src[d]);
    } else if (type == ELEM_FP8_E4M3) {
        const uint8_t *src = (const uint8_t *)base + offset;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) dst[d] = fp8_e4m3_to_float(src[d]);
    } else if (type == ELEM_FP8_E5M2) {
        const uint8_t *src = (const uint8_t *)base + offset;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) dst[d] = fp8_e5m2_to_float(src[d]);
    } else {
        memcpy(dst, (const float *)base + offset, sizeof(float) * (size_t)head_dim);
    }
}

/*
 * One item: the query heads of kv heads [kv_head, kv_head + span) of one request attend
 * over its context positions [start, seq_len) (start > 0: a sliding window), read block
 * by block through `table`; blocks before start's are never read (they may be reused). With span =
 * all kv heads, each position's K (and V) row is one contiguous read.
 * This is the scalar item, for head dims that are not a multiple of 8; the others take
 * paged_decode_avx2.c's (or, for bf16 queries, paged_decode_bf16.c's with AVX-512 BF16).
 * q, acc: [span * group, head_dim]; scores: [span * group, seq_len]
 */
static void attend_scalar(const float *q, const void *key_cache, const void *value_cache, const int64_t *table,
                          int64_t start, int64_t seq_len, int kv_head, int span, int num_kv_heads, int group,
                          int head_dim, int block_size, float scale, float softcap, const float *sinks,
                          int cache_type, float *scores, float *acc) {
    const int heads = span * group;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    float row[span * head_dim];
    float best[heads], total[heads];
    for (int h = 0; h < heads; h++) best[h] = -FLT_MAX;
    const int64_t first_block = start - start % block_size;
    /* Pass 1: scaled scores q . k, block by block. */
    for (int64_t first = first_block; first < seq_len; first += block_size) {
        const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
        const int64_t base = (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim;
        for (int64_t i = first < start ? start - first : 0; i < count; i++) {
            load_row(key_cache, base + i * row_stride, span * head_dim, cache_type, row);
            for (int h = 0; h < heads; h++) {
                const float *qh = q + h * head_dim, *kh = row + (h / group) * head_dim;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                dot *= scale;
                if (softcap > 0.0f) dot = softcap * tanhf(dot / softcap);
                scores[h * seq_len + first + i] = dot;
                best[h] = dot > best[h] ? dot : best[h];
            }
        }
    }
    /* Softmax weights, unnormalised; the sum divides at the end. */
    for (int h = 0; h < heads; h++) {
        float *s = scores + h * seq_len, sum = 0.0f;
        const float top = best[h];
        for (int64_t pos = start; pos < seq_len; pos++) {
            s[pos] = expf(fmaxf(s[pos] - top, SOFTMAX_EXP_FLOOR));
            sum += s[pos];
        }
        total[h] = sum + sink_weight(sinks, h, top);
    }
    /* Pass 2: weighted sum of the value rows. */
    for (int i = 0; i < heads * head_dim; i++) acc[i] = 0.0f;
    for (int64_t first = first_block; first < seq_len; first += block_size) {
        const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
        const int64_t base = (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim;
        for (int64_t i = first < start ? start - first : 0; i < count; i++) {
            load_row(value_cache, base + i * row_stride, span * head_dim, cache_type, row);
            for (int h = 0; h < heads; h++) {
                const float weight = scores[h * seq_len + first + i];
                const float *vh = row + (h / group) * head_dim;
                float *ah = acc + h * head_dim;
                for (int d = 0; d < head_dim; d++) ah[d] += weight * vh[d];
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inverse = 1.0f / total[h];
        for (int d = 0; d < head_dim; d++) acc[h * head_dim + d] *= inverse;
    }
}

/*
 * query:        [*, num_heads, head_dim], row r starts at r * query_row_stride elements
 *               (dtype: ELEM_F32 or ELEM_BF16, as the output)
 * key_cache:    [num_blocks, block_size, num_kv_heads, head_dim] of cache_type (ELEM_*)
 * value_cache:  same shape
 * block_tables: [num_reqs, table_stride]
 * rows, reqs, seq_lens: [num_decodes] row of the flat batch, request index, context length
 * key_starts:   NULL, or [num_decodes] the first context position each row attends to
 *               (a sliding window; such rows take the float32 path, one row per item)
 * softcap:      > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2;
 *               the float32 path); 0: none
 * sinks:        NULL, or [num_heads] float32: each head's learned logit that joins its
 *               softmax's denominator and weighs no value row (gpt-oss's attention sinks)
 * out:          [*, num_heads, head_dim], row r starts at r * out_row_stride elements
 * workspace:    num_threads * max_seq_len * num_heads * MAX_SEGMENT_ROWS floats
 */
int attention_segment_rows(void) { return MAX_SEGMENT_ROWS; }

/* The loop over work items, shared among the threads of the enclosing parallel region
 * (an orphaned `omp for`; called outside any region it runs on the calling thread). */
void paged_decode_attention_in_region(
    const void *query, int64_t query_row_stride,
    const void *key_cache, const void *value_cache,
    const int64_t *block_tables, int64_t table_stride,
    const int64_t *rows, const int64_t *reqs, const int64_t *seq_lens, const int64_t *key_starts,
    int64_t num_decodes, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, float softcap, const float *sinks, int dtype, int cache_type, int num_threads, int64_t max_seq_len,
    void *out, int64_t out_row_stride, float *workspace)
{
    const int group = num_heads / num_kv_heads;
    /* The AVX-512 BF16 item attends from position 0 only, without soft-capping. */
    const int fast_bf16 = dtype == ELEM_BF16 && cache_type != ELEM_F32 && attend_bf16_supported(head_dim) &&
                          key_starts == NULL && softcap == 0.0f;
    /* Consecutive rows of one request at consecutive positions (a speculative
     * verification's k + 1) form one segment: with the bf16 kernel they are one item per
     * kv head, all their query heads reading each K/V block once, each row only up to
     * its own position. Otherwise a segment is one row. */
    int64_t segment_first[num_decodes > 0 ? num_decodes : 1];
    int segment_rows[num_decodes > 0 ? num_decodes : 1];
    int64_t num_segments = 0;
    /* A lone verification (one request, a few rows) in two segments rather than one, so
     * that both halves of the kv heads' items keep the threads busy. */
    const int max_rows = num_decodes <= MAX_SEGMENT_ROWS && num_kv_heads < 2 * num_threads
                             ? (int)(num_decodes + 1) / 2 : MAX_SEGMENT_ROWS;
    for (int64_t d = 0; d < num_decodes; d++) {
        const int64_t previous = num_segments ? segment_first[num_segments - 1] : -1;
        const int joins = fast_bf16 && previous >= 0 && reqs[d] == reqs[previous] &&
                          segment_rows[num_segments - 1] < max_rows &&
                          seq_lens[d] == seq_lens[d - 1] + 1 && rows[d] == rows[d - 1] + 1;
        if (joins) {
            segment_rows[num_segments - 1]++;
        } else {
            segment_first[num_segments] = d;
            segment_rows[num_segments++] = 1;
        }
    }
    /* Many requests: one item per request, reading whole K/V rows. Few requests, or
     * segments of several rows (their heads side by side take one kv head each): split
     * by kv head as well. */
    const int span = num_segments >= 4 * (int64_t)num_threads && num_segments == num_decodes ? num_kv_heads : 1;
    const int items_per_segment = num_kv_heads / span;
    const int64_t num_items = num_segments * items_per_segment;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        const int64_t segment = item / items_per_segment;
        const int64_t decode = segment_first[segment];
        const int count = segment_rows[segment];
        const int kv_head = (int)(item % items_per_segment) * span;
        const int64_t *table = block_tables + reqs[decode] * table_stride;
        float *scores = workspace + (int64_t)thread * max_seq_len * num_heads * MAX_SEGMENT_ROWS;
        const int heads = span * group;
        float q[heads * head_dim], acc[count * heads * head_dim];
        const int64_t first_head = (int64_t)kv_head * group * head_dim;
        const int64_t query_offset = rows[decode] * query_row_stride + first_head;
        const float *item_sinks = sinks ? sinks + (int64_t)kv_head * group : NULL;  /* from the item's first head */
        if (fast_bf16 && count > 1) {  /* span is 1: the rows' query heads side by side */
            uint16_t rows_q[count * heads * head_dim];
            int64_t head_lens[count * heads];
            for (int j = 0; j < count; j++) {
                memcpy(rows_q + (int64_t)j * heads * head_dim,
                       (const uint16_t *)query + rows[decode + j] * query_row_stride + first_head,
                       sizeof(uint16_t) * (size_t)(heads * head_dim));
                for (int h = 0; h < heads; h++) head_lens[j * heads + h] = seq_lens[decode + j];
            }
            attend_bf16(rows_q, key_cache, value_cache, cache_type, table, seq_lens[decode + count - 1], kv_head, 1,
                        num_kv_heads, count * heads, head_dim, block_size, scale, scores, acc, head_lens, item_sinks, heads);
        } else if (fast_bf16) {
            attend_bf16((const uint16_t *)query + query_offset, key_cache, value_cache, cache_type, table,
                        seq_lens[decode], kv_head, span, num_kv_heads, group, head_dim, block_size, scale, scores,
                        acc, NULL, item_sinks, heads);
        } else {
            load_row(query, query_offset, heads * head_dim, dtype, q);
            const int64_t start = key_starts ? key_starts[decode] : 0;
            if (attend_avx2_supported(head_dim))
                attend_avx2(q, key_cache, value_cache, table, start, seq_lens[decode], kv_head, span, num_kv_heads,
                            group, head_dim, block_size, scale, softcap, item_sinks, cache_type, scores, acc);
            else
                attend_scalar(q, key_cache, value_cache, table, start, seq_lens[decode], kv_head, span, num_kv_heads,
                              group, head_dim, block_size, scale, softcap, item_sinks, cache_type, scores, acc);
        }
        for (int j = 0; j < count; j++) {
            const int64_t offset = rows[decode + j] * out_row_stride + first_head;
            const float *result = acc + (int64_t)j * heads * head_dim;
            if (dtype == ELEM_BF16) {
                uint16_t *dst = (uint16_t *)out + offset;
                for (int i = 0; i < heads * head_dim; i++) dst[i] = float_to_bf16(result[i]);
            } else {
                memcpy((float *)out + offset, result, sizeof(float) * (size_t)(heads * head_dim));
            }
        }
    }
}

/* Thread t of nt's share of the step's K and V context blocks, prefetched into L2 (at
 * most max_bytes per thread), called by every thread of a region some time before the
 * attention: the decode layer issues it before the qkv projection so the cache rows,
 * evicted since the last step, arrive while the weights stream. */
void paged_decode_prefetch_in_region(const void *key_cache, const void *value_cache,
                                     const int64_t *block_tables, int64_t table_stride,
                                     const int64_t *reqs, const int64_t *seq_lens, int64_t num_decodes,
                                     int num_kv_heads, int head_dim, int block_size, int element_bytes,
                                     int t, int nt, int64_t max_bytes) {
    const int64_t block_bytes = (int64_t)block_size * num_kv_heads * head_dim * element_bytes;
    int64_t index = 0, issued = 0;
    for (int64_t decode = 0; decode < num_decodes; decode++) {
        const int64_t *table = block_tables + reqs[decode] * table_stride;
        const int64_t num_blocks = (seq_lens[decode] + block_size - 1) / block_size;
        for (int64_t b = 0; b < num_blocks; b++, index++) {
            if (index % nt != t) continue;
            if (issued + 2 * block_bytes > max_bytes) return;
            issued += 2 * block_bytes;
            const char *k = (const char *)key_cache + table[b] * block_bytes;
            const char *v = (const char *)value_cache + table[b] * block_bytes;
            for (int64_t offset = 0; offset < block_bytes; offset += 64) {
                __builtin_prefetch(k + offset, 0, 2);
                __builtin_prefetch(v + offset, 0, 2);
            }
        }
    }
}

void paged_decode_attention(
    const void *query, int64_t query_row_stride,
    const void *key_cache, const void *value_cache,
    const int64_t *block_tables, int64_t table_stride,
    const int64_t *rows, const int64_t *reqs, const int64_t *seq_lens, const int64_t *key_starts,
    int64_t num_decodes, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, float softcap, const float *sinks, int dtype, int cache_type, int num_threads, int64_t max_seq_len,
    void *out, int64_t out_row_stride, float *workspace)
{
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        paged_decode_attention_in_region(query, query_row_stride, key_cache, value_cache, block_tables,
                                         table_stride, rows, reqs, seq_lens, key_starts, num_decodes, num_heads,
                                         num_kv_heads, head_dim, block_size, scale, softcap, sinks, dtype, cache_type, num_threads,
                                         max_seq_len, out, out_row_stride, workspace);
        float_mode_restore(float_mode);
    }
}
