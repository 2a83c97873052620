/* Kernels, CPU: y = x W^T for Q4_0 and Q4_1 weights with x rounded to int8, llama.cpp's
 * arithmetic: the opt-in int8-activation path (EngineArgs.int8_activations).
 *
 * quant_linear.c keeps x in bf16, so every 32 weights cost a bf16 dot product of 32 pairs
 * and the byte unpacking that turns nibbles into bf16 words. Here each group of 32 values
 * of a row of x is rounded to int8 with its own scale (dx = max |x| / 127, as llama.cpp's
 * Q8_0 activations), and one AVX-512 VNNI instruction (vpdpbusd: unsigned bytes times
 * signed bytes, four at a time into int32) multiplies 64 weights' nibbles by 64 int8
 * values. For a group with weight scale d and offset m (Q4_0: m = -8 d):
 *     sum_i x_i w_i ~ dx * (d * dot(u, xq) + m * sum(xq))
 * the first term per lane, scaled by d * dx once per group, the second a vector product
 * over 16 groups at a time.
 *
 * The weights' packed layout is quant_groups.h's: one 64-byte load holds the nibbles of
 * four groups a, b, c, d (a and c in the low nibbles, b and d in the high ones). Two 64-bit
 * lane permutes put the low and high nibbles together as [a b c d]'s first 16 values, then
 * their last 16, so each 32-bit lane of vpdpbusd's sum holds one group, and two vpdpbusd
 * chain into one vector that one conversion and one multiply-add scale per row of x
 * (lanes 4i-4i+3 take group i's scale). x is quantized to match: per run of four groups,
 * group i's first 16 values at 16 i, its last 16 at 64 + 16 i. A shorter tail of groups
 * stays in natural order and is read in pairs with 256-bit instructions.
 *
 * Precision: rounding x to int8 per 32 values costs about 2^-8 of each group's largest
 * value, far more than the bf16 path's order of summation; tests bound it against the
 * dequantized layer. Up to QUANT_INT8_MAX_ROWS rows of x (the decode steps, bound by
 * reading W); quant_linear.c's panels above.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_groups.h"
#include "weights.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define INT8_ROWS 8 /* rows of x per pass over a weight row */

int quant_int8_supported(int type) { return type == WEIGHT_Q4_0 || type == WEIGHT_Q4_1; }

/* x quantized: q[r * q_stride ...] the int8 values in the kernel's order, and per group
 * ds[r * gs + g] = dx, xs[r * gs + g] = dx * sum(q of the group). */
typedef struct {
    int8_t *q;
    float *dx, *xsum;
    int64_t q_stride, group_stride;
} QuantizedX;

static _Thread_local void *quantized_buffer;
static _Thread_local size_t quantized_capacity;

/* The destination of group g's 32 values within its row (see the file comment). */
static inline int64_t group_slot(int64_t g, int64_t full_runs) {
    if (g >= 4 * full_runs) return 32 * g; /* the tail: natural order */
    return 128 * (g / 4) + 16 * (g % 4);
}

static QuantizedX quantize_x(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP, padded = padded_groups(k);
    const int64_t full_runs = groups / 4;
    QuantizedX qx;
    qx.q_stride = 32 * padded;
    qx.group_stride = (padded + 15) / 16 * 16;
    const size_t q_bytes = (size_t)(m * qx.q_stride + 63) / 64 * 64;
    char *buffer = grow_buffer(&quantized_buffer, &quantized_capacity,
                               q_bytes + 2 * sizeof(float) * (size_t)(m * qx.group_stride));
    qx.q = (int8_t *)buffer;
    qx.dx = (float *)(buffer + q_bytes);
    qx.xsum = qx.dx + m * qx.group_stride;
    const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        int8_t *q = qx.q + r * qx.q_stride;
        float *dx = qx.dx + r * qx.group_stride, *xsum = qx.xsum + r * qx.group_stride;
        for (int64_t g = 0; g < groups; g++) {
            const __m512 lo = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 32 * g))), 16));
            const __m512 hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 32 * g + 16))), 16));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            /* A full run keeps each group's halves 64 bytes apart (the file comment); the tail's in order. */
            int8_t *dst = q + group_slot(g, full_runs);
            _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(dst + (g < 4 * full_runs ? 64 : 16)), _mm512_cvtsepi32_epi8(qhi));
            dx[g] = d;
            xsum[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
        for (int64_t g = groups; g < qx.group_stride; g++) {
            if (g < padded) memset(q + 32 * g, 0, 32);
            dx[g] = xsum[g] = 0.0f;
        }
    }
    return qx;
}

/* NR weight rows against M (<= INT8_ROWS) quantized rows of x: result[j * M + r]. NR is 1,
 * or 2 for a single row of x, where the two rows' independent chains keep the vector units
 * busy and share each load of x (one row alone waits on its own latencies: 1.25x slower per
 * row with the weights in cache; four rows at a time gained another 5% there but nothing
 * measurable streaming from memory). */
static inline __attribute__((always_inline)) void int8_rows(int type, int NR, int M, const QuantizedX *qx,
                                                            const uint8_t *const *rows, int64_t k, float *result) {
    const int64_t groups = k / GROUP, stored = padded_groups(k), full_runs = groups / 4;
    const uint16_t *d_half[2], *m_half[2];
    for (int j = 0; j < NR; j++) {
        d_half[j] = (const uint16_t *)(rows[j] + stored * 16);
        m_half[j] = d_half[j] + stored;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* 64-bit lanes of the low nibbles (0-7) and the high ones (8-15): a, b, c, d's first
     * 16 elements, then their last 16. */
    const __m512i first_halves = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i second_halves = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    /* Which of the 16 groups' scales each lane takes, for the run of four at 4i. */
    const __m512i lane_group = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc[2][INT8_ROWS], corr[2][INT8_ROWS];
    __m256 tail[2][INT8_ROWS];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < M; r++) {
            acc[j][r] = corr[j][r] = _mm512_setzero_ps();
            tail[j][r] = _mm256_setzero_ps();
        }
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int count = groups - g0 < 16 ? (int)(groups - g0) : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        __m512 ds[2][INT8_ROWS];
        for (int j = 0; j < NR; j++) {
            const __m512 d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d_half[j] + g0));
            const __m512 min16 = type == WEIGHT_Q4_1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_half[j] + g0))
                                                     : _mm512_mul_ps(d16, _mm512_set1_ps(-8.0f));
            for (int r = 0; r < M; r++) {
                const float *dx = qx->dx + r * qx->group_stride + g0, *xsum = qx->xsum + r * qx->group_stride + g0;
                ds[j][r] = _mm512_mul_ps(d16, _mm512_loadu_ps(dx));
                corr[j][r] = _mm512_fmadd_ps(min16, _mm512_loadu_ps(xsum), corr[j][r]);
            }
        }
        /* Runs of four groups; a whole block of 16 unrolled (the usual case), so each run's
         * scale indices are constants. */
        const int runs = (int)((g0 + count <= 4 * full_runs ? count : 4 * full_runs - g0) / 4);
#define INT8_RUN(G)                                                                                            \
    do {                                                                                                       \
        const int64_t group = g0 + (G);                                                                        \
        const __m512i at = _mm512_add_epi32(lane_group, _mm512_set1_epi32(G));                                 \
        __m512i first[2], second[2];                                                                           \
        for (int j = 0; j < NR; j++) {                                                                         \
            const __m512i packed = _mm512_loadu_si512((const void *)(rows[j] + 16 * group));                   \
            const __m512i low = _mm512_and_si512(packed, low4);                                                \
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);                         \
            first[j] = _mm512_permutex2var_epi64(low, first_halves, high);                                     \
            second[j] = _mm512_permutex2var_epi64(low, second_halves, high);                                   \
        }                                                                                                      \
        for (int r = 0; r < M; r++) {                                                                          \
            const int8_t *xq = qx->q + r * qx->q_stride + 32 * group;                                          \
            const __m512i x_first = _mm512_loadu_si512((const void *)xq);                                      \
            const __m512i x_second = _mm512_loadu_si512((const void *)(xq + 64));                              \
            for (int j = 0; j < NR; j++) {                                                                     \
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first[j], x_first);                    \
                p = _mm512_dpbusd_epi32(p, second[j], x_second);                                               \
                acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(at, ds[j][r]), acc[j][r]); \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)
        int g;
        if (runs == 4 && M <= 2) {
            INT8_RUN(0);
            INT8_RUN(4);
            INT8_RUN(8);
            INT8_RUN(12);
            g = 16;
        } else {
            for (g = 0; g < 4 * runs; g += 4) INT8_RUN(g);
        }
#undef INT8_RUN
        /* The tail: pairs of groups in natural order (an odd last group pairs with the
         * stored zero group, whose x is zero). */
        if (g < count) {
            float ds_buf[INT8_ROWS][16] __attribute__((aligned(64)));
            for (int j = 0; j < NR; j++) {
                for (int r = 0; r < M; r++) _mm512_store_ps(ds_buf[r], ds[j][r]);
                for (int t = g; t < count; t += 2) {
                    const int64_t group = g0 + t;
                    const __m256i packed = _mm256_loadu_si256((const __m256i *)(rows[j] + 16 * group));
                    const __m256i low = _mm256_and_si256(packed, _mm512_castsi512_si256(low4));
                    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm512_castsi512_si256(low4));
                    for (int r = 0; r < M; r++) {
                        const int8_t *xq = qx->q + r * qx->q_stride + 32 * group;
                        const __m256i pa = _mm256_dpbusd_epi32(_mm256_setzero_si256(), low, _mm256_loadu_si256((const __m256i *)xq));
                        const __m256i pb = _mm256_dpbusd_epi32(_mm256_setzero_si256(), high, _mm256_loadu_si256((const __m256i *)(xq + 32)));
                        const float second = t + 1 < count ? ds_buf[r][t + 1] : 0.0f;
                        tail[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pa), _mm256_set1_ps(ds_buf[r][t]), tail[j][r]);
                        tail[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pb), _mm256_set1_ps(second), tail[j][r]);
                    }
                }
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < M; r++) {
            const __m512 sum = _mm512_add_ps(acc[j][r], corr[j][r]);
            result[j * M + r] = _mm512_reduce_add_ps(_mm512_add_ps(sum, _mm512_castps256_ps512(tail[j][r])));
        }
}

typedef void (*int8_fn)(const QuantizedX *, const uint8_t *const *, int64_t, float *);
#define INT8_FN(TYPE, NAME, NR, M)                                                                             \
    static __attribute__((noinline)) void NAME##_##NR##_##M(const QuantizedX *qx, const uint8_t *const *rows, \
                                                            int64_t k, float *result) {                       \
        int8_rows(TYPE, NR, M, qx, rows, k, result);                                                          \
    }
#define INT8_KERNELS(TYPE, NAME)                                                                               \
    INT8_FN(TYPE, NAME, 2, 1)                                                                                  \
    INT8_FN(TYPE, NAME, 1, 1) INT8_FN(TYPE, NAME, 1, 2) INT8_FN(TYPE, NAME, 1, 3) INT8_FN(TYPE, NAME, 1, 4)    \
    INT8_FN(TYPE, NAME, 1, 5) INT8_FN(TYPE, NAME, 1, 6) INT8_FN(TYPE, NAME, 1, 7) INT8_FN(TYPE, NAME, 1, 8)    \
    static const int8_fn NAME[INT8_ROWS + 1] = {0, NAME##_1_1, NAME##_1_2, NAME##_1_3, NAME##_1_4,             \
                                                NAME##_1_5, NAME##_1_6, NAME##_1_7, NAME##_1_8};
INT8_KERNELS(WEIGHT_Q4_0, int8_q4_0)
INT8_KERNELS(WEIGHT_Q4_1, int8_q4_1)

#ifndef INT8_PREFETCH_ROWS
#define INT8_PREFETCH_ROWS 4 /* weight rows read ahead, whole (as quant_linear.c's streaming loop) */
#endif

static inline void prefetch_row(const uint8_t *row, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)row + offset, _MM_HINT_T0);
}

void quant_int8_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                            void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    if (begin >= end) return;
    const QuantizedX qx = quantize_x(x, x_stride, m, k);
    const int q4_1 = p->type == WEIGHT_Q4_1;
    const int8_fn *kernels = q4_1 ? int8_q4_1 : int8_q4_0;
    float result[INT8_ROWS];
    int64_t n = begin;
    if (m == 1) /* two weight rows at a time (int8_rows' comment) */
        for (; n + 2 <= end; n += 2) {
            const uint8_t *rows[2] = {p->data + n * p->row_bytes, p->data + (n + 1) * p->row_bytes};
            if (n + INT8_PREFETCH_ROWS + 2 <= end) prefetch_row(rows[0] + INT8_PREFETCH_ROWS * p->row_bytes, 2 * p->row_bytes);
            (q4_1 ? int8_q4_1_2_1 : int8_q4_0_2_1)(&qx, rows, k, result);
            for (int j = 0; j < 2; j++)
                store_float(out, n + j, result[j] + (bias ? bf16_to_float(bias[n + j]) : 0.0f), out_f32);
        }
    for (; n < end; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        if (n + INT8_PREFETCH_ROWS < end) prefetch_row(row + INT8_PREFETCH_ROWS * p->row_bytes, p->row_bytes);
        const float b = bias ? bf16_to_float(bias[n]) : 0.0f;
        for (int64_t first = 0; first < m; first += INT8_ROWS) {
            const int rows = m - first < INT8_ROWS ? (int)(m - first) : INT8_ROWS;
            QuantizedX part = qx;
            part.q += first * qx.q_stride;
            part.dx += first * qx.group_stride;
            part.xsum += first * qx.group_stride;
            kernels[rows](&part, &row, k, result);
            for (int r = 0; r < rows; r++) store_float(out, (first + r) * out_stride + n, result[r] + b, out_f32);
        }
    }
}
#else
int quant_int8_supported(int type) {
    (void)type;
    return 0;
}
#endif
