/* Attention stage, CPU: one decode work item of paged_decode.c for bf16 caches, with
 * AVX-512 BF16 (head_dim 64 or 128).
 *
 * A decode step of many requests reads every request's K and V once per layer, as many
 * bytes as the weights or more, with little arithmetic on them. The generic loop widens
 * each K row to float32 and reduces one dot product at a time (a horizontal sum per key
 * and head); here the query, already bf16, meets the bf16 K rows in bf16 dot-product
 * instructions (the products are exact in float32), and the dot products of 16 keys are
 * reduced together into one vector of 16 scores. The value pass widens each V row once
 * and accumulates the heads that share it in registers. Both passes go block by block,
 * reading each block's rows of the item's kv heads front to back. Scores, softmax and sums stay
 * float32 as in the generic loop.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "float_mode.h"
#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

int attend_bf16_supported(int head_dim) { return head_dim == 64 || head_dim == 128; }

/* out[j] = the sum of the lanes of a[j], j = 0..15. */
static inline __m512 sum_lanes_16(__m512 a[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int j = 0; j < 8; j++)  /* each 128-bit lane: partial sums of keys 2j and 2j+1, interleaved */
        pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
    for (int j = 0; j < 4; j++) {  /* each 128-bit lane: [key 4j, 4j+1, 4j+2, 4j+3] */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(pairs[2 * j]), _mm512_castps_pd(pairs[2 * j + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(pairs[2 * j]), _mm512_castps_pd(pairs[2 * j + 1]));
        quads[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    for (int j = 0; j < 2; j++)  /* lanes: [quad 2j: l0+l1, l2+l3, quad 2j+1: l0+l1, l2+l3] */
        halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* Widen 16 bf16 values to float32. */
static inline __m512 widen(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

/* acc[h] += sum over one block's `count` keys of p[h][key] * V[key], for `NH` heads that
 * share the kv head whose rows start at `rows` (stride `row_stride`); the heads'
 * accumulators stay in registers while the rows go by. */
#define DEFINE_VALUE_BLOCK(NAME, D, NH)                                                        \
static void NAME(const uint16_t *rows, int64_t row_stride, int64_t count, const float *p,     \
                 int64_t p_stride, float *acc) {                                               \
    __m512 a[NH][D / 16];                                                                      \
    for (int h = 0; h < NH; h++)                                                               \
        for (int j = 0; j < D / 16; j++) a[h][j] = _mm512_loadu_ps(acc + h * D + 16 * j);      \
    for (int64_t i = 0; i < count; i++) {                                                      \
        __m512 v[D / 16];                                                                      \
        for (int j = 0; j < D / 16; j++) v[j] = widen(rows + i * row_stride + 16 * j);         \
        for (int h = 0; h < NH; h++) {                                                         \
            const __m512 weight = _mm512_set1_ps(p[h * p_stride + i]);                         \
            for (int j = 0; j < D / 16; j++) a[h][j] = _mm512_fmadd_ps(weight, v[j], a[h][j]); \
        }                                                                                      \
    }                                                                                          \
    for (int h = 0; h < NH; h++)                                                               \
        for (int j = 0; j < D / 16; j++) _mm512_storeu_ps(acc + h * D + 16 * j, a[h][j]);      \
}
DEFINE_VALUE_BLOCK(values_64_1, 64, 1)
DEFINE_VALUE_BLOCK(values_64_2, 64, 2)
DEFINE_VALUE_BLOCK(values_64_3, 64, 3)
DEFINE_VALUE_BLOCK(values_64_4, 64, 4)
DEFINE_VALUE_BLOCK(values_128_1, 128, 1)
DEFINE_VALUE_BLOCK(values_128_2, 128, 2)

typedef void (*value_block_fn)(const uint16_t *, int64_t, int64_t, const float *, int64_t, float *);
static const value_block_fn VALUES_64[5] = {0, values_64_1, values_64_2, values_64_3, values_64_4};
static const value_block_fn VALUES_128[3] = {0, values_128_1, values_128_2};

/* Scaled scores q . k of `heads` query heads (kv head h / group) for one block's `count`
 * keys, 16 keys at a time; top[h] keeps each head's running maximum. */
#define DEFINE_SCORE_BLOCK(NAME, D)                                                            \
static void NAME(const uint16_t *q, const uint16_t *rows, int64_t row_stride, int64_t count, \
                 int heads, int group, float scale, float *scores, int64_t score_stride,       \
                 __m512 *top) {                                                                \
    for (int64_t chunk = 0; chunk < count; chunk += 16) {                                      \
        const int n = count - chunk < 16 ? (int)(count - chunk) : 16;                          \
        const __mmask16 valid = (__mmask16)((1u << n) - 1);                                    \
        for (int h = 0; h < heads; h++) {                                                      \
            const uint16_t *keys = rows + (h / group) * D + chunk * row_stride;                \
            __m512bh qh[D / 32];                                                               \
            for (int j = 0; j < D / 32; j++)                                                   \
                qh[j] = (__m512bh)_mm512_loadu_si512((const void *)(q + h * D + 32 * j));      \
            __m512 dots[16];                                                                   \
            for (int i = 0; i < 16; i++) {                                                     \
                dots[i] = _mm512_setzero_ps();                                                 \
                if (i >= n) continue;                                                          \
                for (int j = 0; j < D / 32; j++)                                               \
                    dots[i] = _mm512_dpbf16_ps(dots[i], qh[j],                                  \
                        (__m512bh)_mm512_loadu_si512((const void *)(keys + i * row_stride + 32 * j))); \
            }                                                                                  \
            const __m512 s = _mm512_mul_ps(sum_lanes_16(dots), _mm512_set1_ps(scale));         \
            _mm512_mask_storeu_ps(scores + h * score_stride + chunk, valid, s);               \
            top[h] = _mm512_mask_max_ps(top[h], valid, top[h], s);                             \
        }                                                                                      \
    }                                                                                          \
}
DEFINE_SCORE_BLOCK(scores_64, 64)
DEFINE_SCORE_BLOCK(scores_128, 128)

/* Read the item's rows of the block holding context position `first` (if any) front to
 * back, a couple of blocks before they are used. The cache was written steps ago and
 * evicted since; the passes below touch a block's rows head by head, a strided order in
 * which cache misses are served one small batch at a time. Plain loads in address order
 * let the hardware stream the block instead (measured at 32 requests x 150 tokens,
 * every layer's cache cold: 128 us per layer against 186 with no warming and the same
 * with software prefetch instructions). */
static inline void warm_block(const uint16_t *cache, const int64_t *table, int64_t first, int64_t seq_len,
                              int block_size, int num_kv_heads, int kv_head, int span, int head_dim) {
    if (first >= seq_len || span < num_kv_heads) return;  /* whole rows only: a block is one span of memory */
    const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    const uint16_t *start = cache + (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim;
    const int row_elements = span * head_dim;
    __m512i seen = _mm512_setzero_si512();
    for (int64_t i = 0; i < count; i++)
        for (int offset = 0; offset < row_elements; offset += 32)
            seen = _mm512_or_si512(seen, _mm512_loadu_si512((const void *)(start + i * row_stride + offset)));
    volatile int keep = _mm512_reduce_or_epi32(seen);  /* the loads must happen */
    (void)keep;
}

#define WARM_AHEAD_BLOCKS 2

/* The work item of paged_decode.c: query heads of kv heads [kv_head, kv_head + span) of
 * one request over its context, block by block (each block's rows of the item's kv
 * heads are read together, front to back). q: bf16 [span * group, head_dim]; acc:
 * float32, same shape, normalised on return; scores: [span * group, seq_len] floats. */
void attend_bf16(const uint16_t *q, const uint16_t *key_cache, const uint16_t *value_cache, const int64_t *table,
                 int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim,
                 int block_size, float scale, float *scores, float *acc) {
    const int heads = span * group;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    const int chunk_heads = head_dim == 64 ? 4 : 2;  /* value accumulators that fit in registers */
    __m512 top[heads];
    float total[heads];
    for (int h = 0; h < heads; h++) top[h] = _mm512_set1_ps(-FLT_MAX);
    for (int b = 0; b < WARM_AHEAD_BLOCKS; b++)
        warm_block(key_cache, table, (int64_t)b * block_size, seq_len, block_size, num_kv_heads, kv_head, span, head_dim);
    for (int64_t first = 0; first < seq_len; first += block_size) {
        warm_block(key_cache, table, first + WARM_AHEAD_BLOCKS * block_size, seq_len, block_size, num_kv_heads,
                       kv_head, span, head_dim);
        const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
        const uint16_t *rows = key_cache + (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim;
        if (head_dim == 64)
            scores_64(q, rows, row_stride, count, heads, group, scale, scores + first, seq_len, top);
        else
            scores_128(q, rows, row_stride, count, heads, group, scale, scores + first, seq_len, top);
    }
    for (int b = 0; b < WARM_AHEAD_BLOCKS; b++)
        warm_block(value_cache, table, (int64_t)b * block_size, seq_len, block_size, num_kv_heads, kv_head, span,
                       head_dim);
    for (int h = 0; h < heads; h++) {  /* unnormalised softmax weights; the sum divides at the end */
        float *s = scores + h * seq_len, sum = 0.0f;
        const float best = _mm512_reduce_max_ps(top[h]);
        for (int64_t pos = 0; pos < seq_len; pos++) {
            s[pos] = expf(fmaxf(s[pos] - best, SOFTMAX_EXP_FLOOR));
            sum += s[pos];
        }
        total[h] = sum;
    }
    for (int i = 0; i < heads * head_dim; i++) acc[i] = 0.0f;
    for (int64_t first = 0; first < seq_len; first += block_size) {
        warm_block(value_cache, table, first + WARM_AHEAD_BLOCKS * block_size, seq_len, block_size, num_kv_heads,
                       kv_head, span, head_dim);
        const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
        const uint16_t *block = value_cache + (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim;
        for (int g = 0; g < span; g++)
            for (int h = 0; h < group; h += chunk_heads) {
                const int nh = group - h < chunk_heads ? group - h : chunk_heads;
                const value_block_fn pass = head_dim == 64 ? VALUES_64[nh] : VALUES_128[nh];
                const int head = g * group + h;
                pass(block + g * head_dim, row_stride, count, scores + head * seq_len + first, seq_len,
                     acc + head * head_dim);
            }
    }
    for (int h = 0; h < heads; h++) {
        const float inverse = 1.0f / total[h];
        for (int d = 0; d < head_dim; d++) acc[h * head_dim + d] *= inverse;
    }
}
#else
int attend_bf16_supported(int head_dim) {
    (void)head_dim;
    return 0;
}
void attend_bf16(const uint16_t *q, const uint16_t *key_cache, const uint16_t *value_cache, const int64_t *table,
                 int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim,
                 int block_size, float scale, float *scores, float *acc) {
    (void)q; (void)key_cache; (void)value_cache; (void)table; (void)seq_len; (void)kv_head; (void)span;
    (void)num_kv_heads; (void)group; (void)head_dim; (void)block_size; (void)scale; (void)scores; (void)acc;
}
#endif
