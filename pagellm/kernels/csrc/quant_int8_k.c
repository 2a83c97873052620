/* Kernels, CPU: y = x W^T for Q4_K and Q6_K weights as stored, with x rounded to int8 per
 * 32 values (the opt-in int8-activation path, EngineArgs.int8_activations; quant_int8.c
 * serves Q4_0 / Q4_1). AVX-512 VNNI builds only: the AVX2 builds stream these types with
 * bf16 activations.
 *
 * The weights stay in llama.cpp's super-block layout, so x is rounded into the order in
 * which a 64-byte load of the weights' low and high nibbles (or 6-bit values) lines up with
 * it, and one vpdpbusd multiplies 64 weights by 64 int8 values into 16 int32 lanes, each the
 * sum of four products of one group of 32:
 *  - Q4_K: 32 bytes of nibbles hold groups 2p (low) and 2p + 1 (high), so one load of 64
 *    bytes is groups a, b, c, d with a and c in the low nibbles. x is rounded with the
 *    groups of each run of four in the order a, c, b, d: the low nibbles meet x's first 64
 *    values, the high ones the next 64. Lanes 0-7 of a product are group a (or b), lanes
 *    8-15 group c (or d), each scaled by its d * scale * dx (a permute of the super-block's
 *    eight scales); the mins' term is -dmin * min * dx * sum(xq) over the eight groups.
 *  - Q6_K: 64 bytes of ql are elements 0-63 (low nibbles) and 64-127 (high) of half a
 *    super-block, the 2-bit planes of qh complete them (shifted by 0 and 2 for the first
 *    32 bytes' lanes, 4 and 6 for the high nibbles), so x keeps its natural order; each
 *    4 lanes share one of the 16 int8 scales. The values are stored plus 32: the term
 *    -32 d scale dx sum(xq) takes x's sums over each 16 values.
 * Per super-block and row of x: four vpdpbusd, four conversions, four permutes and four
 * multiply-adds for 256 weights (the bf16 path: eight byte unpackings and eight bf16 dot
 * products). Precision as quant_int8.c: x rounded to int8 costs about 2^-8 of each group's
 * largest value; tests bound it.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_groups.h"
#include "weights.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define K_ROWS 8 /* rows of x per pass over a weight row */
/* Which of four accumulators a row's j-th product of a super-block adds into: four chains
 * for one or two rows of x (the multiply-adds' latency would bound a single chain), two
 * for more rows (chains enough, and the registers are short). */
#define CHAIN(j) (M <= 2 ? (j) : (j) & 1)

/* x rounded: q[r * q_stride ...] the int8 values in the weight type's order; per group of
 * 32, dx[r * groups + g] = max |x| / 127 and xsum[...] = dx * sum(q); per 16 values,
 * xsum16[r * 2 groups + s] = dx * sum(q) over those 16. */
typedef struct {
    int8_t *q;
    float *dx, *xsum, *xsum16;
    int64_t groups;
} KQuantizedX;

static _Thread_local void *k_buffer;
static _Thread_local size_t k_capacity;

/* The slot of group g within its run of four: a, c, b, d for Q4_K (file comment). */
static inline int64_t q4_k_slot(int64_t g) {
    const int64_t i = g & 3;
    return (g & ~(int64_t)3) + (i == 1 ? 2 : i == 2 ? 1 : i);
}

static KQuantizedX quantize_x_k(int type, const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    KQuantizedX qx;
    qx.groups = k / GROUP;
    const size_t q_bytes = (size_t)(m * k + 63) / 64 * 64;
    char *buffer = grow_buffer(&k_buffer, &k_capacity, q_bytes + 4 * sizeof(float) * (size_t)(m * qx.groups));
    qx.q = (int8_t *)buffer;
    qx.dx = (float *)(buffer + q_bytes);
    qx.xsum = qx.dx + m * qx.groups;
    qx.xsum16 = qx.xsum + m * qx.groups;
    const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        for (int64_t g = 0; g < qx.groups; g++) {
            const __m512 lo = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 32 * g))), 16));
            const __m512 hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 32 * g + 16))), 16));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            const int64_t slot = type == WEIGHT_Q4_K ? q4_k_slot(g) : g;
            int8_t *q = qx.q + r * k + 32 * slot;
            _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qhi));
            const float first = (float)_mm512_reduce_add_epi32(qlo), second = (float)_mm512_reduce_add_epi32(qhi);
            qx.dx[r * qx.groups + g] = d;
            qx.xsum[r * qx.groups + g] = d * (first + second);
            qx.xsum16[2 * (r * qx.groups + g)] = d * first;
            qx.xsum16[2 * (r * qx.groups + g) + 1] = d * second;
        }
    }
    return qx;
}

/* One Q4_K weight row against M rows of x. */
static inline __attribute__((always_inline)) void q4_k_rows(int M, const KQuantizedX *qx, const uint8_t *row,
                                                            int64_t k, float *result) {
    __m512 acc[4][K_ROWS], corr[K_ROWS];
    for (int r = 0; r < M; r++) acc[0][r] = acc[1][r] = acc[2][r] = acc[3][r] = corr[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i pick_ac = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i pick_bd = _mm512_add_epi32(pick_ac, _mm512_set1_epi32(1));
    const __m512i four = _mm512_set1_epi32(4);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *block = row + b * Q4_K_BLOCK_BYTES;
        uint64_t scales, mins;
        k_scales_mins(block + 4, &scales, &mins);
        const __m512 d8 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scales))));
        const __m512 m8 = _mm512_mul_ps(_mm512_set1_ps(-half_to_float(block + 2)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mins))));
        const __m512i packed0 = _mm512_loadu_si512((const void *)(block + 16));
        const __m512i packed1 = _mm512_loadu_si512((const void *)(block + 80));
        const __m512i lo0 = _mm512_and_si512(packed0, low4), hi0 = _mm512_and_si512(_mm512_srli_epi16(packed0, 4), low4);
        const __m512i lo1 = _mm512_and_si512(packed1, low4), hi1 = _mm512_and_si512(_mm512_srli_epi16(packed1, 4), low4);
        for (int r = 0; r < M; r++) {
            const int64_t at = r * qx->groups + 8 * b;
            corr[r] = _mm512_fmadd_ps(m8, _mm512_maskz_loadu_ps(0xFF, qx->xsum + at), corr[r]);
            const __m512 ds = _mm512_mul_ps(d8, _mm512_maskz_loadu_ps(0xFF, qx->dx + at));
            const int8_t *xq = qx->q + r * k + 256 * b;
            const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, _mm512_loadu_si512((const void *)xq));
            const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi0, _mm512_loadu_si512((const void *)(xq + 64)));
            const __m512i p2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo1, _mm512_loadu_si512((const void *)(xq + 128)));
            const __m512i p3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi1, _mm512_loadu_si512((const void *)(xq + 192)));
            acc[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(pick_ac, ds), acc[0][r]);
            acc[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(pick_bd, ds), acc[1][r]);
            acc[CHAIN(2)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p2), _mm512_permutexvar_ps(_mm512_add_epi32(pick_ac, four), ds), acc[CHAIN(2)][r]);
            acc[CHAIN(3)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p3), _mm512_permutexvar_ps(_mm512_add_epi32(pick_bd, four), ds), acc[CHAIN(3)][r]);
        }
    }
    for (int r = 0; r < M; r++)
        result[r] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]), _mm512_add_ps(acc[2][r], acc[3][r])), corr[r]));
}

/* One Q6_K weight row against M rows of x. */
static inline __attribute__((always_inline)) void q6_k_rows(int M, const KQuantizedX *qx, const uint8_t *row,
                                                            int64_t k, float *result) {
    __m512 acc[4][K_ROWS], corr[K_ROWS];
    for (int r = 0; r < M; r++) acc[0][r] = acc[1][r] = acc[2][r] = acc[3][r] = corr[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
    /* qh's bit pairs: the first 32 bytes' lanes take bits 0-1 (low nibbles) or 4-5 (high
     * ones), the next 32 bytes' bits 2-3 or 6-7 (file comment). */
    const __m512i shift_low = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_high = _mm512_add_epi16(shift_low, _mm512_set1_epi16(4));
    /* lane i of the low (high) values of half h: 16-value scale 8 h + i / 4 (+ 4) */
    const __m512i pick_low = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i pick_high = _mm512_add_epi32(pick_low, _mm512_set1_epi32(4));
    const __m512i eight = _mm512_set1_epi32(8);
    const __m512i dx_of_sub = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *block = row + b * Q6_K_BLOCK_BYTES;
        const __m512 d16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))));
        const __m512 offset16 = _mm512_mul_ps(d16, _mm512_set1_ps(-32.0f));
        __m512i values[4]; /* half 0 low, high; half 1 low, high */
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(block + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h)));
            const __m512i top_low = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_low), low2);
            const __m512i top_high = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_high), low2);
            values[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(top_low, 4));
            values[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_slli_epi16(top_high, 4));
        }
        for (int r = 0; r < M; r++) {
            const int64_t at = r * qx->groups + 8 * b;
            corr[r] = _mm512_fmadd_ps(offset16, _mm512_loadu_ps(qx->xsum16 + 2 * at), corr[r]);
            const __m512 ds = _mm512_mul_ps(d16, _mm512_permutexvar_ps(dx_of_sub, _mm512_maskz_loadu_ps(0xFF, qx->dx + at)));
            const int8_t *xq = qx->q + r * k + 256 * b;
            for (int h = 0; h < 2; h++) {
                const __m512i p_low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), values[2 * h],
                                                          _mm512_loadu_si512((const void *)(xq + 128 * h)));
                const __m512i p_high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), values[2 * h + 1],
                                                           _mm512_loadu_si512((const void *)(xq + 128 * h + 64)));
                const __m512i base = h ? eight : _mm512_setzero_si512();
                acc[CHAIN(2 * h)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_low), _mm512_permutexvar_ps(_mm512_add_epi32(pick_low, base), ds), acc[CHAIN(2 * h)][r]);
                acc[CHAIN(2 * h + 1)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_high), _mm512_permutexvar_ps(_mm512_add_epi32(pick_high, base), ds), acc[CHAIN(2 * h + 1)][r]);
            }
        }
    }
    for (int r = 0; r < M; r++)
        result[r] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]), _mm512_add_ps(acc[2][r], acc[3][r])), corr[r]));
}

typedef void (*k_fn)(const KQuantizedX *, const uint8_t *, int64_t, float *);
#define K_FN(ROWS_FN, M)                                                                                      \
    static __attribute__((noinline)) void ROWS_FN##_##M(const KQuantizedX *qx, const uint8_t *row, int64_t k, \
                                                        float *result) {                                      \
        ROWS_FN(M, qx, row, k, result);                                                                       \
    }
#define K_KERNELS(ROWS_FN)                                                                                  \
    K_FN(ROWS_FN, 1) K_FN(ROWS_FN, 2) K_FN(ROWS_FN, 3) K_FN(ROWS_FN, 4) K_FN(ROWS_FN, 5) K_FN(ROWS_FN, 6) \
        K_FN(ROWS_FN, 7) K_FN(ROWS_FN, 8)                                                                   \
            static const k_fn ROWS_FN##_by_rows[K_ROWS + 1] = {0,          ROWS_FN##_1, ROWS_FN##_2,          \
                                                               ROWS_FN##_3, ROWS_FN##_4, ROWS_FN##_5,         \
                                                               ROWS_FN##_6, ROWS_FN##_7, ROWS_FN##_8};
K_KERNELS(q4_k_rows)
K_KERNELS(q6_k_rows)

int quant_int8_k_supported(int type) { return type == WEIGHT_Q4_K || type == WEIGHT_Q6_K; }

void quant_int8_k_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                              void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    if (begin >= end) return;
    const KQuantizedX qx = quantize_x_k(p->type, x, x_stride, m, k);
    const k_fn *kernels = p->type == WEIGHT_Q4_K ? q4_k_rows_by_rows : q6_k_rows_by_rows;
    const int64_t ahead = stream_prefetch_rows(p->row_bytes);
    float result[K_ROWS];
    for (int64_t n = begin; n < end; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        stream_prefetch(row, p->row_bytes, n, ahead, end);
        const float b = bias ? bf16_to_float(bias[n]) : 0.0f;
        for (int64_t first = 0; first < m; first += K_ROWS) {
            const int rows = m - first < K_ROWS ? (int)(m - first) : K_ROWS;
            KQuantizedX part = qx;
            part.q += first * k;
            part.dx += first * qx.groups;
            part.xsum += first * qx.groups;
            part.xsum16 += 2 * first * qx.groups;
            kernels[rows](&part, row, k, result);
            for (int r = 0; r < rows; r++) store_float(out, (first + r) * out_stride + n, result[r] + b, out_f32);
        }
    }
}
#else
int quant_int8_k_supported(int type) {
    (void)type;
    return 0;
}

void quant_int8_k_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                              void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    (void)x, (void)x_stride, (void)p, (void)bias, (void)out, (void)out_stride, (void)out_f32, (void)m, (void)k;
    (void)t, (void)nt;
}
#endif
