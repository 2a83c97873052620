/* Kernels, CPU: y = x W^T for MXFP4 and Q8_0 rows as stored (quant_groups.h's row-packed
 * layouts), with x rounded to int8 per 32 values: the opt-in int8-activation path
 * (EngineArgs.int8_activations) on AVX-512 VNNI builds. quant_int8.c serves Q4_0 / Q4_1
 * (and MXFP4 on the AVX2 builds), quant_int8_k.c the K-quants.
 *
 * Both types are groups of 32 integers times one scale per group, so the int8 products are
 * exact and only x's rounding costs precision (as quant_int8.c). One vpdpbusd multiplies 64
 * unsigned weight bytes by 64 int8 values of x into 16 int32 lanes of four products each:
 *  - MXFP4: a 64-byte load of nibbles is four groups a, b, c, d (a and c in the low nibbles,
 *    b and d in the high ones, element order); each nibble looked up as its doubled E2M1
 *    value plus 12 (MXFP4_UNSIGNED_TABLE: 0 to 24, w = d u - 12 d). x is rounded into the
 *    order a, c, b, d per run of four groups, so the low nibbles meet x's first 64 bytes and
 *    the high ones its next 64; lanes 0-7 hold one group, 8-15 the other.
 *  - Q8_0: the signed bytes of two groups per load, their sign bit flipped (u = w + 128,
 *    w = u - 128), x in its natural order.
 * Per run of four groups and row of x: two vpdpbusd, two conversions, two permutes of the
 * groups' d dx into their lanes and two multiply-adds; the offsets' term (-12 d or -128 d
 * times dx sum(xq)) once per 16 groups, one vector product. The bf16 path instead widens
 * each weight to bf16 (a lookup and a permute per 32 for MXFP4, three conversions for
 * Q8_0) and spends a bf16 dot product per 32 weights.
 *
 * A row's groups need not fill whole runs of four (gpt-oss's 2880 is 90 groups): a last
 * run of two stored groups (MXFP4 pairs its groups, padding an odd count with a zero group)
 * is one 32-byte pair, x kept in natural order there; Q8_0's short last run reads its bytes
 * with a masked load. Groups past the row's end have x zero and scale zero, so they add 0.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_groups.h"
#include "weights.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define G_ROWS 8 /* rows of x per pass over a weight row */
/* Two accumulators per row of x for one or two rows (the multiply-adds' latency would
 * bound a single chain), one for more (chains enough, and registers are short). */
#define G_CHAIN(j) (M <= 2 ? (j) : 0)

/* x rounded: q[r * q_stride ...] the int8 values in the type's order (groups past the row's
 * end zero, up to a whole run of four); per group dx[r * group_stride + g] = max |x| / 127 and
 * xsum = dx * sum(q), zero past the row's end up to a multiple of 16 groups. */
typedef struct {
    int8_t *q;
    float *dx, *xsum;
    int64_t q_stride, group_stride;
} GroupsX;

static _Thread_local void *g_buffer;
static _Thread_local size_t g_capacity;

/* Groups the row stores: MXFP4 pads an odd count to even (quant_groups.h). */
static inline int64_t stored_groups(int type, int64_t k) { return type == WEIGHT_MXFP4 ? padded_groups(k) : k / GROUP; }

static GroupsX quantize_x_groups(int type, const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP, runs = (groups + 3) / 4;
    /* MXFP4's groups in runs of four stored groups take the order a, c, b, d; a last pair stays natural */
    const int64_t paired = type == WEIGHT_MXFP4 ? stored_groups(type, k) / 4 * 4 : 0;
    GroupsX qx;
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
            const int64_t i = g & 3, slot = g < paired ? (g & ~(int64_t)3) + (i == 1 ? 2 : i == 2 ? 1 : i) : g;
            _mm_storeu_si128((__m128i *)(q + 32 * slot), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(q + 32 * slot + 16), _mm512_cvtsepi32_epi8(qhi));
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
static inline __attribute__((always_inline)) void groups_rows(int type, int M, const GroupsX *qx, const uint8_t *row,
                                                              int64_t k, float *result) {
    const int is_mx = type == WEIGHT_MXFP4;
    const int64_t groups = k / GROUP, stored = stored_groups(type, k);
    const uint8_t *scales = row + (is_mx ? 16 * stored : k); /* MXFP4: exponent bytes; Q8_0: fp16 d */
    const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)MXFP4_UNSIGNED_TABLE));
    __m512 acc[2][G_ROWS];
    for (int r = 0; r < M; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int count = groups - g0 < 16 ? (int)(groups - g0) : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        const __m512 d16 = is_mx ? e8m0_half16(scales + g0, mask)
                                 : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)scales + g0));
        const __m512 min16 = _mm512_mul_ps(d16, _mm512_set1_ps(is_mx ? -12.0f : -128.0f));
        __m512 ds[G_ROWS];
        for (int r = 0; r < M; r++) {
            const int64_t at = r * qx->group_stride + g0;
            acc[0][r] = _mm512_fmadd_ps(min16, _mm512_loadu_ps(qx->xsum + at), acc[0][r]);
            ds[r] = _mm512_mul_ps(d16, _mm512_loadu_ps(qx->dx + at));
        }
        for (int q = 0; q < count; q += 4) {
            const int64_t group = g0 + q;
            __m512i first, second; /* the weights of products 0 and 1 */
            __m512i lanes0, lanes1; /* their groups' lanes in ds */
            int products = 2;
            if (is_mx && group + 4 <= stored) {
                const __m512i packed = _mm512_loadu_si512((const void *)(row + 16 * group));
                first = _mm512_shuffle_epi8(table, _mm512_and_si512(packed, low4));
                second = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4));
                lanes0 = two_groups(q, q + 2);
                lanes1 = two_groups(q + 1, q + 3);
            } else if (is_mx) { /* the last pair: its low nibbles one group, its high ones the next */
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(row + 16 * group));
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1);
                first = _mm512_shuffle_epi8(table, _mm512_and_si512(both, low4));
                lanes0 = two_groups(q, q + 1);
                second = lanes1 = _mm512_setzero_si512();
                products = 1;
            } else { /* Q8_0: a short last run reads only its groups' bytes */
                const int have = count - q < 4 ? count - q : 4;
                const __mmask64 m0 = have >= 2 ? ~(__mmask64)0 : (((__mmask64)1 << 32) - 1);
                const __mmask64 m1 = have >= 4 ? ~(__mmask64)0 : have == 3 ? (((__mmask64)1 << 32) - 1) : 0;
                first = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m0, row + 32 * group), flip);
                second = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m1, row + 32 * group + 64), flip);
                lanes0 = two_groups(q, q + 1);
                lanes1 = two_groups(q + 2, q + 3);
                products = have > 2 ? 2 : 1;
            }
            for (int r = 0; r < M; r++) {
                const int8_t *xq = qx->q + r * qx->q_stride + 32 * group;
                const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), first, _mm512_loadu_si512((const void *)xq));
                acc[G_CHAIN(0)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(lanes0, ds[r]), acc[G_CHAIN(0)][r]);
                if (products == 2) {
                    const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), second, _mm512_loadu_si512((const void *)(xq + 64)));
                    acc[G_CHAIN(1)][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(lanes1, ds[r]), acc[G_CHAIN(1)][r]);
                }
            }
        }
    }
    for (int r = 0; r < M; r++) result[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
}

typedef void (*groups_fn)(const GroupsX *, const uint8_t *, int64_t, float *);
#define G_FN(TYPE, NAME, M)                                                                                        \
    static __attribute__((noinline)) void NAME##_##M(const GroupsX *qx, const uint8_t *row, int64_t k, float *result) { \
        groups_rows(TYPE, M, qx, row, k, result);                                                                  \
    }
#define G_KERNELS(TYPE, NAME)                                                                               \
    G_FN(TYPE, NAME, 1) G_FN(TYPE, NAME, 2) G_FN(TYPE, NAME, 3) G_FN(TYPE, NAME, 4) G_FN(TYPE, NAME, 5)     \
        G_FN(TYPE, NAME, 6) G_FN(TYPE, NAME, 7) G_FN(TYPE, NAME, 8) static const groups_fn NAME[G_ROWS + 1] = { \
            0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};
G_KERNELS(WEIGHT_MXFP4, mxfp4_rows)
G_KERNELS(WEIGHT_Q8_0, q8_0_rows)

int quant_int8_groups_supported(int type) { return type == WEIGHT_MXFP4 || type == WEIGHT_Q8_0; }

void quant_int8_groups_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                                   void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    if (begin >= end) return;
    const GroupsX qx = quantize_x_groups(p->type, x, x_stride, m, k);
    const groups_fn *kernels = p->type == WEIGHT_MXFP4 ? mxfp4_rows : q8_0_rows;
    const int64_t ahead = stream_prefetch_rows(p->row_bytes);
    float result[G_ROWS];
    for (int64_t n = begin; n < end; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        stream_prefetch(row, p->row_bytes, n, ahead, end);
        const float b = bias ? bf16_to_float(bias[n]) : 0.0f;
        for (int64_t first = 0; first < m; first += G_ROWS) {
            const int rows = m - first < G_ROWS ? (int)(m - first) : G_ROWS;
            GroupsX part = qx;
            part.q += first * qx.q_stride;
            part.dx += first * qx.group_stride;
            part.xsum += first * qx.group_stride;
            kernels[rows](&part, row, k, result);
            for (int r = 0; r < rows; r++) store_float(out, (first + r) * out_stride + n, result[r] + b, out_f32);
        }
    }
}
#else
int quant_int8_groups_supported(int type) {
    (void)type;
    return 0;
}

void quant_int8_groups_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                                   void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    (void)x, (void)x_stride, (void)p, (void)bias, (void)out, (void)out_stride, (void)out_f32, (void)m, (void)k;
    (void)t, (void)nt;
}
#endif
