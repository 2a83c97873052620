/* Attention stage, CPU: one decode work item of paged_decode.c for bf16 queries over a
 * bf16 or fp8 cache, with AVX-512 BF16 (head_dim 64 or 128).
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
 *
 * fp8 caches (fp8.h) move half the bytes. Their values are widened in registers through
 * float16, exactly: e5m2 is the top byte of a float16 (shift left 8); for e4m3,
 * (sign << 15) | ((x & 0x7f) << 7) is a float16 equal to the e4m3 value times 2^-8
 * (exponent bias 15 against 7), its subnormals included (e4m3fn's NaN, 0x7f/0xff,
 * never occurs: stores saturate). The 2^-8 is folded into the score scale and the final
 * normalisation (exact: powers of two). The K pass converts 16 keys' rows to bf16 once,
 * into a small buffer the bf16 score loop then reads; the V pass widens each row to float32
 * as it goes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "float_mode.h"
#include "fp8.h"
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

/* fp8 bytes (widened to 16-bit lanes) -> float16 bits: e5m2 exactly, e4m3 times 2^-8.
 * For e4m3, x << 7 puts the magnitude in place and the sign at bit 14; adding bit 14 to
 * itself moves the sign to bit 15. */
static inline __m512i e4m3_to_half_32(__m512i x) {
    const __m512i y = _mm512_slli_epi16(x, 7);
    return _mm512_add_epi16(y, _mm512_and_si512(y, _mm512_set1_epi16(0x4000)));
}
static inline __m256i e4m3_to_half_16(__m256i x) {
    const __m256i y = _mm256_slli_epi16(x, 7);
    return _mm256_add_epi16(y, _mm256_and_si256(y, _mm256_set1_epi16(0x4000)));
}

/* Widen 16 fp8 values to float32 (e4m3: times 2^-8). */
static inline __m512 widen_e4m3(const uint8_t *src) {
    return _mm512_cvtph_ps(e4m3_to_half_16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src))));
}
static inline __m512 widen_e5m2(const uint8_t *src) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src)), 8));
}

/* n (a multiple of 32) fp8 values -> bf16 (e4m3: times 2^-8), exactly. */
static void fp8_to_bf16(const uint8_t *src, uint16_t *dst, int n, int type) {
    for (int i = 0; i < n; i += 32) {
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + i)));
        const __m512i h = type == ELEM_FP8_E4M3 ? e4m3_to_half_32(x) : _mm512_slli_epi16(x, 8);
        const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        _mm512_storeu_si512((void *)(dst + i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* acc[h] += sum over one block's `count` keys of p[h][key] * V[key], for `NH` heads that
 * share the kv head whose rows (of element type T, widened by WIDEN) start at `base`
 * (stride `row_stride` elements); the heads' accumulators stay in registers while the
 * rows go by. */
#define DEFINE_VALUE_BLOCK(NAME, D, NH, T, WIDEN)                                              \
static void NAME(const void *base, int64_t row_stride, int64_t count, const float *p,         \
                 int64_t p_stride, float *acc) {                                               \
    const T *rows = (const T *)base;                                                           \
    __m512 a[NH][D / 16];                                                                      \
    for (int h = 0; h < NH; h++)                                                               \
        for (int j = 0; j < D / 16; j++) a[h][j] = _mm512_loadu_ps(acc + h * D + 16 * j);      \
    for (int64_t i = 0; i < count; i++) {                                                      \
        __m512 v[D / 16];                                                                      \
        for (int j = 0; j < D / 16; j++) v[j] = WIDEN(rows + i * row_stride + 16 * j);         \
        for (int h = 0; h < NH; h++) {                                                         \
            const __m512 weight = _mm512_set1_ps(p[h * p_stride + i]);                         \
            for (int j = 0; j < D / 16; j++) a[h][j] = _mm512_fmadd_ps(weight, v[j], a[h][j]); \
        }                                                                                      \
    }                                                                                          \
    for (int h = 0; h < NH; h++)                                                               \
        for (int j = 0; j < D / 16; j++) _mm512_storeu_ps(acc + h * D + 16 * j, a[h][j]);      \
}
typedef void (*value_block_fn)(const void *, int64_t, int64_t, const float *, int64_t, float *);

/* The value passes of one cache element type: up to 4 heads at head_dim 64, 2 at 128. */
#define DEFINE_VALUE_BLOCKS(SUFFIX, T, WIDEN)                                                  \
DEFINE_VALUE_BLOCK(values_64_1_##SUFFIX, 64, 1, T, WIDEN)                                      \
DEFINE_VALUE_BLOCK(values_64_2_##SUFFIX, 64, 2, T, WIDEN)                                      \
DEFINE_VALUE_BLOCK(values_64_3_##SUFFIX, 64, 3, T, WIDEN)                                      \
DEFINE_VALUE_BLOCK(values_64_4_##SUFFIX, 64, 4, T, WIDEN)                                      \
DEFINE_VALUE_BLOCK(values_128_1_##SUFFIX, 128, 1, T, WIDEN)                                    \
DEFINE_VALUE_BLOCK(values_128_2_##SUFFIX, 128, 2, T, WIDEN)                                    \
static const value_block_fn VALUES_64_##SUFFIX[5] = {                                         \
    0, values_64_1_##SUFFIX, values_64_2_##SUFFIX, values_64_3_##SUFFIX, values_64_4_##SUFFIX}; \
static const value_block_fn VALUES_128_##SUFFIX[3] = {0, values_128_1_##SUFFIX, values_128_2_##SUFFIX};
DEFINE_VALUE_BLOCKS(bf16, uint16_t, widen)
DEFINE_VALUE_BLOCKS(e4m3, uint8_t, widen_e4m3)
DEFINE_VALUE_BLOCKS(e5m2, uint8_t, widen_e5m2)

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
static inline void warm_block(const void *cache, const int64_t *table, int64_t first, int64_t seq_len,
                              int block_size, int num_kv_heads, int kv_head, int span, int head_dim,
                              int element_bytes) {
    if (first >= seq_len || span < num_kv_heads) return;  /* whole rows only: a block is one span of memory */
    const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim * element_bytes;
    const char *start = (const char *)cache
                      + (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim * element_bytes;
    const int row_bytes = span * head_dim * element_bytes;  /* a multiple of 64: head_dim is 64 or 128 */
    __m512i seen = _mm512_setzero_si512();
    for (int64_t i = 0; i < count; i++)
        for (int offset = 0; offset < row_bytes; offset += 64)
            seen = _mm512_or_si512(seen, _mm512_loadu_si512((const void *)(start + i * row_stride + offset)));
    volatile int keep = _mm512_reduce_or_epi32(seen);  /* the loads must happen */
    (void)keep;
}

#define WARM_AHEAD_BLOCKS 2

/* Scores of one block's `count` keys whose fp8 rows (all `span` kv heads of the item,
 * stride row_stride) start at `rows`: 16 keys at a time converted to bf16 (e4m3: times
 * 2^-8, which `scale` makes up for), then the bf16 score loop. */
static void scores_fp8(const uint16_t *q, const uint8_t *rows, int64_t row_stride, int64_t count, int heads,
                       int group, int span, int head_dim, int type, float scale, float *scores,
                       int64_t score_stride, __m512 *top) {
    const int row_elements = span * head_dim;
    uint16_t keys[16 * row_elements];
    for (int64_t chunk = 0; chunk < count; chunk += 16) {
        const int64_t n = count - chunk < 16 ? count - chunk : 16;
        for (int64_t i = 0; i < n; i++)
            fp8_to_bf16(rows + (chunk + i) * row_stride, keys + i * row_elements, row_elements, type);
        if (head_dim == 64)
            scores_64(q, keys, row_elements, n, heads, group, scale, scores + chunk, score_stride, top);
        else
            scores_128(q, keys, row_elements, n, heads, group, scale, scores + chunk, score_stride, top);
    }
}

/* The work item of paged_decode.c: query heads of kv heads [kv_head, kv_head + span) of
 * one request over its context, block by block (each block's rows of the item's kv
 * heads are read together, front to back). q: bf16 [span * group, head_dim]; the caches
 * of cache_type (ELEM_BF16 or an fp8 type); acc: float32, same shape as q, normalised on
 * return; scores: [span * group, seq_len] floats. head_lens: NULL, or per head the
 * positions it attends to (<= seq_len: several query rows of one request in one item). */
void attend_bf16(const uint16_t *q, const void *key_cache, const void *value_cache, int cache_type,
                 const int64_t *table, int64_t seq_len, int kv_head, int span, int num_kv_heads, int group,
                 int head_dim, int block_size, float scale, float *scores, float *acc, const int64_t *head_lens,
                 const float *sinks, int sink_period) {
    const int heads = span * group;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;  /* elements */
    const int element_bytes = elem_bytes(cache_type);
    const int chunk_heads = head_dim == 64 ? 4 : 2;  /* value accumulators that fit in registers */
    /* e4m3 values are widened as value * 2^-8: scores and sums are made up for here. */
    const float unit = cache_type == ELEM_FP8_E4M3 ? 256.0f : 1.0f;
    const value_block_fn *values = cache_type == ELEM_FP8_E4M3 ? (head_dim == 64 ? VALUES_64_e4m3 : VALUES_128_e4m3)
                                 : cache_type == ELEM_FP8_E5M2 ? (head_dim == 64 ? VALUES_64_e5m2 : VALUES_128_e5m2)
                                 : (head_dim == 64 ? VALUES_64_bf16 : VALUES_128_bf16);
    __m512 top[heads];
    float total[heads];
    for (int h = 0; h < heads; h++) top[h] = _mm512_set1_ps(-FLT_MAX);
    for (int b = 0; b < WARM_AHEAD_BLOCKS; b++)
        warm_block(key_cache, table, (int64_t)b * block_size, seq_len, block_size, num_kv_heads, kv_head, span, head_dim,
                   element_bytes);
    for (int64_t first = 0; first < seq_len; first += block_size) {
        warm_block(key_cache, table, first + WARM_AHEAD_BLOCKS * block_size, seq_len, block_size, num_kv_heads,
                   kv_head, span, head_dim, element_bytes);
        const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
        const int64_t row0 = (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim;
        if (cache_type != ELEM_BF16)
            scores_fp8(q, (const uint8_t *)key_cache + row0, row_stride, count, heads, group, span, head_dim,
                       cache_type, scale * unit, scores + first, seq_len, top);
        else if (head_dim == 64)
            scores_64(q, (const uint16_t *)key_cache + row0, row_stride, count, heads, group, scale, scores + first,
                      seq_len, top);
        else
            scores_128(q, (const uint16_t *)key_cache + row0, row_stride, count, heads, group, scale, scores + first,
                       seq_len, top);
    }
    for (int b = 0; b < WARM_AHEAD_BLOCKS; b++)
        warm_block(value_cache, table, (int64_t)b * block_size, seq_len, block_size, num_kv_heads, kv_head, span,
                   head_dim, element_bytes);
    for (int h = 0; h < heads; h++) {  /* unnormalised softmax weights; the sum divides at the end */
        float *s = scores + h * seq_len, sum = 0.0f;
        float best = _mm512_reduce_max_ps(top[h]);
        /* A head of an earlier query row sees only its first head_lens[h] positions: its
         * maximum is taken over those, and the later positions weigh 0. */
        const int64_t len = head_lens ? head_lens[h] : seq_len;
        if (len < seq_len) {
            best = -FLT_MAX;
            for (int64_t pos = 0; pos < len; pos++) best = fmaxf(best, s[pos]);
            for (int64_t pos = len; pos < seq_len; pos++) s[pos] = 0.0f;
        }
        for (int64_t pos = 0; pos < len; pos++) {
            s[pos] = expf(fmaxf(s[pos] - best, SOFTMAX_EXP_FLOOR));
            sum += s[pos];
        }
        total[h] = sum + sink_weight(sinks, h % sink_period, best);  /* head h is row h / sink_period's */
    }
    for (int i = 0; i < heads * head_dim; i++) acc[i] = 0.0f;
    for (int64_t first = 0; first < seq_len; first += block_size) {
        warm_block(value_cache, table, first + WARM_AHEAD_BLOCKS * block_size, seq_len, block_size, num_kv_heads,
                   kv_head, span, head_dim, element_bytes);
        const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
        const char *block = (const char *)value_cache
                          + (table[first / block_size] * block_size * num_kv_heads + kv_head) * head_dim * element_bytes;
        for (int g = 0; g < span; g++)
            for (int h = 0; h < group; h += chunk_heads) {
                const int nh = group - h < chunk_heads ? group - h : chunk_heads;
                const int head = g * group + h;
                values[nh](block + (int64_t)g * head_dim * element_bytes, row_stride, count,
                           scores + head * seq_len + first, seq_len, acc + head * head_dim);
            }
    }
    for (int h = 0; h < heads; h++) {
        const float inverse = unit / total[h];
        for (int d = 0; d < head_dim; d++) acc[h * head_dim + d] *= inverse;
    }
}
#else
int attend_bf16_supported(int head_dim) {
    (void)head_dim;
    return 0;
}
void attend_bf16(const uint16_t *q, const void *key_cache, const void *value_cache, int cache_type,
                 const int64_t *table, int64_t seq_len, int kv_head, int span, int num_kv_heads, int group,
                 int head_dim, int block_size, float scale, float *scores, float *acc, const int64_t *head_lens,
                 const float *sinks, int sink_period) {
    (void)head_lens; (void)sinks; (void)sink_period;
    (void)q; (void)key_cache; (void)value_cache; (void)cache_type; (void)table; (void)seq_len; (void)kv_head; (void)span;
    (void)num_kv_heads; (void)group; (void)head_dim; (void)block_size; (void)scale; (void)scores; (void)acc;
}
#endif
