/* Attention stage, CPU: one decode work item of paged_decode.c in AVX2 float32, for
 * every cache type and head_dim a multiple of 8 (the kernel builds without AVX-512 BF16
 * take it for bf16 queries too; all builds for float32 queries, sliding windows and
 * soft-capping).
 *
 * The scalar item it replaces reduced one dot product at a time (a horizontal sum per key
 * and head) and widened each K row once per head: on a 2-core Zen 3 a decode over 1000
 * positions of SmolLM2's 3 kv heads read its 768 KB of K and V at about 3 GB/s, as long
 * as the layer's weights took. Here the K pass widens 8 keys' rows once into a small
 * buffer, every query head of the kv head meets them in FMAs (8 partial vectors, one per
 * key), and the 8 keys' sums are reduced together into one vector of 8 scores. The V pass
 * keeps the sums of up to 8 query heads over a few 8-column slices in registers while it
 * walks the positions (enough independent chains for the multiply-adds' latency), each
 * V slice widened once for all of them. Scores, softmax and
 * sums are float32 as in the scalar item, in another order of additions.
 *
 * fp8 caches are widened exactly through float16 (F16C): e5m2 is the top byte of a
 * float16; for e4m3, (sign << 15) | ((x & 0x7f) << 7) is a float16 equal to the value
 * times 2^-8 (subnormals included), multiplied back by 256 (exact).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "float_mode.h"
#include "fp8.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define KEYS 8          /* keys whose dot products are reduced together */
#define VALUE_HEADS 8   /* query heads accumulated together in the value pass */
#define MAX_HEAD_DIM 256

int attend_avx2_supported(int head_dim) { return head_dim > 0 && head_dim % 8 == 0 && head_dim <= MAX_HEAD_DIM; }

/* Eight cache elements `offset` elements into `base`, as float32 (exactly). */
static inline __m256 widen8(const void *base, int64_t offset, int type) {
    if (type == ELEM_BF16) {
        const __m128i words = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
    }
    if (type == ELEM_F32) return _mm256_loadu_ps((const float *)base + offset);
    const __m128i words = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)base + offset)));
    if (type == ELEM_FP8_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(words, 8));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(words, _mm_set1_epi16(0x80)), 8);
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(words, _mm_set1_epi16(0x7f)), 7);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, magnitude)), _mm256_set1_ps(256.0f));
}

/* Lane k of the result: the sum of the lanes of a[k]. */
static inline __m256 sum_keys8(const __m256 a[KEYS]) {
    /* hadd: [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* each 128-bit half holds keys' partial sums over one half of their lanes */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* Where one item's value rows lie: the cache, its element type, the request's blocks. */
typedef struct {
    const void *cache;
    int type, block_size;
    const int64_t *table;
    int64_t first_block, start, seq_len, row_stride;
} ValueRows;

/* S 8-column slices, from column offset `column` of each value row, of NH query heads'
 * weighted sums (weights: NH rows of scores, seq_len apart), each divided by its softmax
 * sum. NH and S are constants where this is inlined, so the NH x S sums stay in registers
 * (and are enough independent chains for the multiply-adds' latency). */
static inline __attribute__((always_inline)) void value_slices(int NH, int S, const ValueRows *rows, int64_t column,
                                                               const float *weights, const float *inverse,
                                                               float *out, int64_t head_dim) {
    __m256 sums[VALUE_HEADS][8];
    for (int j = 0; j < NH; j++)
        for (int s = 0; s < S; s++) sums[j][s] = _mm256_setzero_ps();
    for (int64_t first = rows->first_block; first < rows->seq_len; first += rows->block_size) {
        const int64_t count = rows->seq_len - first < rows->block_size ? rows->seq_len - first : rows->block_size;
        const int64_t base = rows->table[first / rows->block_size] * rows->block_size * rows->row_stride + column;
        for (int64_t i = first < rows->start ? rows->start - first : 0; i < count; i++) {
            __m256 v[8];
            for (int s = 0; s < S; s++) v[s] = widen8(rows->cache, base + i * rows->row_stride + 8 * s, rows->type);
            for (int j = 0; j < NH; j++) {
                const __m256 w = _mm256_broadcast_ss(weights + (int64_t)j * rows->seq_len + first + i);
                for (int s = 0; s < S; s++) sums[j][s] = _mm256_fmadd_ps(w, v[s], sums[j][s]);
            }
        }
    }
    for (int j = 0; j < NH; j++)
        for (int s = 0; s < S; s++)
            _mm256_storeu_ps(out + j * head_dim + 8 * s, _mm256_mul_ps(sums[j][s], _mm256_set1_ps(inverse[j])));
}

/* NH query heads of one kv head (column: its first column in a row), all their slices, S
 * at a time (NH x S <= 12 sums), the rest one at a time. */
#define VALUE_HEADS_FN(NH, S)                                                                                        \
    static void value_heads_##NH(const ValueRows *rows, int64_t column, int slices, const float *weights,              \
                                 const float *inverse, float *out, int64_t head_dim) {                                 \
        int c = 0;                                                                                                     \
        for (; c + S <= slices; c += S) value_slices(NH, S, rows, column + 8 * c, weights, inverse, out + 8 * c, head_dim); \
        for (; c < slices; c++) value_slices(NH, 1, rows, column + 8 * c, weights, inverse, out + 8 * c, head_dim);   \
    }
VALUE_HEADS_FN(1, 8)
VALUE_HEADS_FN(2, 4)
VALUE_HEADS_FN(3, 4)
VALUE_HEADS_FN(4, 2)
VALUE_HEADS_FN(5, 2)
VALUE_HEADS_FN(6, 2)
VALUE_HEADS_FN(7, 1)
VALUE_HEADS_FN(8, 1)

typedef void (*value_heads_fn)(const ValueRows *, int64_t, int, const float *, const float *, float *, int64_t);
static const value_heads_fn value_heads[VALUE_HEADS + 1] = {0, value_heads_1, value_heads_2, value_heads_3,
                                                            value_heads_4, value_heads_5, value_heads_6,
                                                            value_heads_7, value_heads_8};

/* The same work item as paged_decode.c's scalar one (its comment gives the arguments).
 * HEAD_DIM is a constant where this is inlined (64, 128), or head_dim_arg (0): with the
 * constant, the key pass's loops unroll (35 against 48 cycles per key row and kv head of
 * SmolLM2's shape, one Zen 3 core). */
static inline __attribute__((always_inline)) void attend_item(
    int HEAD_DIM, const float *q, const void *key_cache, const void *value_cache, const int64_t *table, int64_t start,
    int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim_arg, int block_size, float scale,
    float softcap, const float *sinks, int cache_type, float *scores, float *acc) {
    const int head_dim = HEAD_DIM ? HEAD_DIM : head_dim_arg;
    const int heads = span * group, slices = head_dim / 8;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t first_block = start - start % block_size;
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
    float keys[KEYS * MAX_HEAD_DIM] __attribute__((aligned(32)));
    __m256 best[heads];
    for (int h = 0; h < heads; h++) best[h] = lowest;
    /* Pass 1: scaled scores q . k, 8 keys of a block at a time. */
    for (int64_t first = first_block; first < seq_len; first += block_size) {
        const int64_t count = seq_len - first < block_size ? seq_len - first : block_size;
        const int64_t base = table[first / block_size] * block_size * row_stride + (int64_t)kv_head * head_dim;
        for (int64_t i = first < start ? start - first : 0; i < count; i += KEYS) {
            const int n = count - i < KEYS ? (int)(count - i) : KEYS;
            const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int u = 0; u < span; u++) {
                for (int k = 0; k < KEYS; k++) { /* a short chunk repeats its last key (its scores are not kept) */
                    const int64_t at = base + (i + (k < n ? k : n - 1)) * row_stride + (int64_t)u * head_dim;
                    for (int c = 0; c < slices; c++)
                        _mm256_store_ps(keys + k * head_dim + 8 * c, widen8(key_cache, at + 8 * c, cache_type));
                }
                for (int g = 0; g < group; g++) {
                    const int h = u * group + g;
                    const float *qh = q + (int64_t)h * head_dim;
                    __m256 dot[KEYS];
                    for (int k = 0; k < KEYS; k++) dot[k] = _mm256_setzero_ps();
                    for (int c = 0; c < slices; c++) {
                        const __m256 qv = _mm256_loadu_ps(qh + 8 * c);
                        for (int k = 0; k < KEYS; k++)
                            dot[k] = _mm256_fmadd_ps(qv, _mm256_load_ps(keys + k * head_dim + 8 * c), dot[k]);
                    }
                    __m256 s = _mm256_mul_ps(sum_keys8(dot), _mm256_set1_ps(scale));
                    if (softcap > 0.0f) {
                        float lanes[KEYS] __attribute__((aligned(32)));
                        _mm256_store_ps(lanes, s);
                        for (int k = 0; k < KEYS; k++) lanes[k] = softcap * tanhf(lanes[k] / softcap);
                        s = _mm256_load_ps(lanes);
                    }
                    _mm256_maskstore_ps(scores + (int64_t)h * seq_len + first + i, live, s);
                    best[h] = _mm256_max_ps(best[h], _mm256_blendv_ps(lowest, s, _mm256_castsi256_ps(live)));
                }
            }
        }
    }
    /* Softmax weights, unnormalised; the sum divides at the end. */
    float inverse[heads];
    for (int h = 0; h < heads; h++) {
        float *s = scores + (int64_t)h * seq_len, sum = 0.0f;
        const float top = max8(best[h]);
        for (int64_t pos = start; pos < seq_len; pos++) {
            s[pos] = expf(fmaxf(s[pos] - top, SOFTMAX_EXP_FLOOR));
            sum += s[pos];
        }
        inverse[h] = 1.0f / (sum + sink_weight(sinks, h, top));
    }
    /* Pass 2: weighted sums of the value rows, up to VALUE_HEADS query heads of one kv head
     * at a time (value_slices). */
    const ValueRows rows = {value_cache, cache_type, block_size, table, first_block, start, seq_len, row_stride};
    for (int u = 0; u < span; u++) {
        for (int g0 = 0; g0 < group; g0 += VALUE_HEADS) {
            const int h0 = u * group + g0, nh = group - g0 < VALUE_HEADS ? group - g0 : VALUE_HEADS;
            value_heads[nh](&rows, (int64_t)(kv_head + u) * head_dim, slices, scores + (int64_t)h0 * seq_len,
                            inverse + h0, acc + (int64_t)h0 * head_dim, head_dim);
        }
    }
}

#define ATTEND_FN(NAME, HEAD_DIM)                                                                                    \
    static void NAME(const float *q, const void *key_cache, const void *value_cache, const int64_t *table,           \
                     int64_t start, int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim,  \
                     int block_size, float scale, float softcap, const float *sinks, int cache_type, float *scores,     \
                     float *acc) {                                                                                    \
        attend_item(HEAD_DIM, q, key_cache, value_cache, table, start, seq_len, kv_head, span, num_kv_heads, group,   \
                    head_dim, block_size, scale, softcap, sinks, cache_type, scores, acc);                            \
    }
ATTEND_FN(attend_64, 64)
ATTEND_FN(attend_128, 128)
ATTEND_FN(attend_any, 0)

void attend_avx2(const float *q, const void *key_cache, const void *value_cache, const int64_t *table, int64_t start,
                 int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim, int block_size,
                 float scale, float softcap, const float *sinks, int cache_type, float *scores, float *acc) {
    const __typeof__(&attend_any) item = head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any;
    item(q, key_cache, value_cache, table, start, seq_len, kv_head, span, num_kv_heads, group, head_dim, block_size,
         scale, softcap, sinks, cache_type, scores, acc);
}
#else
int attend_avx2_supported(int head_dim) {
    (void)head_dim;
    return 0;
}
void attend_avx2(const float *q, const void *key_cache, const void *value_cache, const int64_t *table, int64_t start,
                 int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim, int block_size,
                 float scale, float softcap, const float *sinks, int cache_type, float *scores, float *acc) {
    (void)sinks;
    (void)q; (void)key_cache; (void)value_cache; (void)table; (void)start; (void)seq_len; (void)kv_head; (void)span;
    (void)num_kv_heads; (void)group; (void)head_dim; (void)block_size; (void)scale; (void)softcap; (void)cache_type;
    (void)scores; (void)acc;
}
#endif
