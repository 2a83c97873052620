/* Kernels, CPU: y = x W^T for Q8_0 rows as stored (quant_groups.h: a row's int8 values, then
 * its fp16 scales), with x rounded to int8 per 32 values: the opt-in int8-activation path
 * (EngineArgs.int8_activations) on AVX-512 VNNI builds. quant_int8.c serves Q4_0 / Q4_1 /
 * MXFP4, quant_int8_k.c the K-quants.
 *
 * The weights are groups of 32 integers times one scale each, so the int8 products are
 * exact and only x's rounding costs precision (as quant_int8.c). One vpdpbusd multiplies 64
 * unsigned bytes by 64 int8 values of x into 16 int32 lanes of four products each; the
 * weights' bytes are signed, so their sign bit is flipped (u = w + 128, w = u - 128) and the
 * offset's term, -128 d dx sum(xq) per group, is one vector product per 16 groups. A 64-byte
 * load is two groups (lanes 0-7 and 8-15), x in its natural order. Per two groups and row of
 * x: one vpdpbusd, one conversion, one permute of the groups' d dx into their lanes and one
 * multiply-add; the bf16 path widens each byte to bf16 (three conversions per 16) and spends a
 * bf16 dot product per 32 weights. A row's last groups short of a run of four are read with a
 * masked load; x past the row's end is zero.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_groups.h"
#include "weights.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define Q8_ROWS 8 /* rows of x per pass over a weight row */
/* Two accumulators per row of x for one or two rows (the multiply-adds' latency would
 * bound a single chain), one for more (chains enough, and registers are short). */
#define Q8_CHAIN(j) (M <= 2 ? (j) : 0)

/* x rounded: q[r * q_stride ...] the int8 values (groups past the row's end zero, up to a
 * whole run of four); per group dx[r * group_stride + g] = max |x| / 127 and
 * xsum = dx * sum(q), zero past the row's end up to a multiple of 16 groups. */
typedef struct {
    int8_t *q;
    float *dx, *xsum;
    int64_t q_stride, group_stride;
} Q8X;

static _Thread_local void *g_buffer;
static _Thread_local size_t g_capacity;

static Q8X quantize_x_q8(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP, runs = (groups + 3) / 4;
    Q8X qx;
    qx.q_stride = 128 * runs;
    qx.group_stride = (groups + 15) / 16 * 16;
    const size_t q_bytes = (size_t)(m * qx.q_stride);
    char *buffer = grow_buffer(&g_buffer, &g_capacity, q_bytes + 2 * sizeof(float) * (size_t)(m * qx.group_stride));
    qx.q = (int8_t *)buffer;
    qx.dx = (float *)(buffer + q_bytes);
    qx.xsum = qx.dx + m * qx.group_stride;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        int8_t *q = qx.q + r * qx.q_stride;
        float *dx = qx.dx + r * qx.group_stride, *xsum = qx.xsum + r * qx.group_stride;
        memset(q + 32 * groups, 0, (size_t)(qx.q_stride - 32 * groups));
        for (int64_t g = groups; g < qx.group_stride; g++) dx[g] = xsum[g] = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            __m512i qlo, qhi;
            const float d = round_group_to_int8(row + 32 * g, &qlo, &qhi);
            _mm_storeu_si128((__m128i *)(q + 32 * g), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(q + 32 * g + 16), _mm512_cvtsepi32_epi8(qhi));
            dx[g] = d;
            xsum[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
    }
    return qx;
}

/* The lanes of group `first` (lanes 0-7) and group `second` (8-15) of a 16-group vector. */
static inline __m512i two_groups(int first, int second) {
    return _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(first), _mm512_set1_epi32(second));
}

/* One weight row against M rows of x. */
static inline __attribute__((always_inline)) void q8_rows(int M, const Q8X *qx, const uint8_t *row, int64_t k,
                                                          float *result) {
    const int64_t groups = k / GROUP;
    const uint16_t *scales = (const uint16_t *)(row + k);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[2][Q8_ROWS];
    for (int r = 0; r < M; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int count = groups - g0 < 16 ? (int)(groups - g0) : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        const __m512 d16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + g0));
        const __m512 min16 = _mm512_mul_ps(d16, _mm512_set1_ps(-128.0f));
        __m512 ds[Q8_ROWS];
        for (int r = 0; r < M; r++) {
            const int64_t at = r * qx->group_stride + g0;
            acc[0][r] = _mm512_fmadd_ps(min16, _mm512_loadu_ps(qx->xsum + at), acc[0][r]);
            ds[r] = _mm512_mul_ps(d16, _mm512_loadu_ps(qx->dx + at));
        }
        for (int q = 0; q < count; q += 4) {
            const int64_t group = g0 + q;
            /* a short last run reads only its groups' bytes (the row's scales follow them) */
            const int have = count - q < 4 ? count - q : 4;
            const __mmask64 m0 = have >= 2 ? ~(__mmask64)0 : (((__mmask64)1 << 32) - 1);
            const __mmask64 m1 = have >= 4 ? ~(__mmask64)0 : have == 3 ? (((__mmask64)1 << 32) - 1) : 0;
            const __m512i first = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m0, row + 32 * group), flip);
            const __m512i second = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m1, row + 32 * group + 64), flip);
            const __m512i lanes0 = two_groups(q, q + 1), lanes1 = two_groups(q + 2, q + 3);
            for (int r = 0; r < M; r++) {
                const int8_t *xq = qx->q + r * qx->q_stride + 32 * group;
                const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void *)xq));
                acc[Q8_CHAIN(0)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(lanes0, ds[r]), acc[Q8_CHAIN(0)][r]);
                if (have > 2) {
                    const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), second, _mm512_loadu_si512((const void *)(xq + 64)));
                    acc[Q8_CHAIN(1)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(lanes1, ds[r]), acc[Q8_CHAIN(1)][r]);
                }
            }
        }
    }
    for (int r = 0; r < M; r++) result[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
}

typedef void (*q8_fn)(const Q8X *, const uint8_t *, int64_t, float *);
#define Q8_FN(M)                                                                                            \
    static __attribute__((noinline)) void q8_rows_##M(const Q8X *qx, const uint8_t *row, int64_t k, float *result) { \
        q8_rows(M, qx, row, k, result);                                                                     \
    }
Q8_FN(1) Q8_FN(2) Q8_FN(3) Q8_FN(4) Q8_FN(5) Q8_FN(6) Q8_FN(7) Q8_FN(8)
static const q8_fn q8_kernels[Q8_ROWS + 1] = {0, q8_rows_1, q8_rows_2, q8_rows_3, q8_rows_4,
                                             q8_rows_5, q8_rows_6, q8_rows_7, q8_rows_8};

int quant_int8_q8_supported(int type) { return type == WEIGHT_Q8_0; }

void quant_int8_q8_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                                   void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    if (begin >= end) return;
    const Q8X qx = quantize_x_q8(x, x_stride, m, k);
    const int64_t ahead = stream_prefetch_rows(p->row_bytes);
    float result[Q8_ROWS];
    for (int64_t n = begin; n < end; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        stream_prefetch(row, p->row_bytes, n, ahead, end);
        const float b = bias ? bf16_to_float(bias[n]) : 0.0f;
        for (int64_t first = 0; first < m; first += Q8_ROWS) {
            const int rows = m - first < Q8_ROWS ? (int)(m - first) : Q8_ROWS;
            Q8X part = qx;
            part.q += first * qx.q_stride;
            part.dx += first * qx.group_stride;
            part.xsum += first * qx.group_stride;
            q8_kernels[rows](&part, row, k, result);
            for (int r = 0; r < rows; r++) store_float(out, (first + r) * out_stride + n, result[r] + b, out_f32);
        }
    }
}
#else
int quant_int8_q8_supported(int type) {
    (void)type;
    return 0;
}

void quant_int8_q8_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                                   void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    (void)x, (void)x_stride, (void)p, (void)bias, (void)out, (void)out_stride, (void)out_f32, (void)m, (void)k;
    (void)t, (void)nt;
}
#endif
