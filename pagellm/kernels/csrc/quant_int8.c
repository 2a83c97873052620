/* Kernels, CPU: y = x W^T for Q4_0, Q4_1 and MXFP4 weights with x rounded to int8, llama.cpp's
 * arithmetic: the opt-in int8-activation path (EngineArgs.int8_activations). MXFP4 is read
 * as Q4_0 (the same row layout and lane order), each nibble looked up as twice its E2M1
 * value plus 12 (quant_groups.h MXFP4_UNSIGNED_TABLE, 0 to 24: unsigned bytes) with
 * m = -12 d and d = 2^(E - 128) from its exponent bytes.
 *
 * quant_linear.c keeps x in bf16, so every 32 weights cost a bf16 dot product of 32 pairs
 * and the byte unpacking that turns nibbles into bf16 words. Here each group of 32 values
 * of a row of x is rounded to int8 with its own scale (dx = max |x| / 127, as llama.cpp's
 * Q8_0 activations), and one AVX-512 VNNI instruction (vpdpbusd: unsigned bytes times
 * signed bytes, four at a time into int32) multiplies 64 weights' nibbles by 64 int8
 * values. For a group with weight scale d and offset m (Q4_0: m = -8 d):
 *     sum_i x_i w_i ~ dx * (d * dot(u, xq) + m * sum(xq))
 * the first term per group, the second a vector product over 16 groups at a time.
 *
 * Two builds of it. With AVX-512 VNNI (below), the weights are the VNNI types (weights.h):
 * Q4_0 / Q4_1 rows repacked at load
 * (kernels/weights.py, vnni_part) so that every 32-bit lane of a vpdpbusd sums four weights
 * of one group. Per 16 groups, 256 bytes: byte 64 L + 4 g + i holds element 8 L + i of
 * group g in its low nibble and element 8 L + 4 + i in its high one (L = 0..3, g = 0..15,
 * i = 0..3), so the low nibbles of the 64-byte load L are register 2 L and the high ones
 * register 2 L + 1, and in register R lane g holds elements 4 R .. 4 R + 3 of group g. x is
 * quantized into the same order (byte 64 R + 4 g + i: element 4 R + i of group g): eight
 * vpdpbusd leave each lane a whole group's integer dot product, scaled once per 16 groups
 * by one conversion and one multiply-add (the file layout, groups' nibbles side by side,
 * needs lane permutes and a scaling per four groups: about 40 instructions per 16 groups
 * and row against 22 here). Groups after the last 16 keep the pair layout of
 * quant_groups.h (2p low, 2p + 1 high nibbles of 32 bytes) and x its natural order, read
 * two groups at a time with 256-bit instructions. The fp16 scales (and Q4_1 mins) follow
 * the nibbles as in quant_groups.h.
 *
 * Precision: rounding x to int8 per 32 values costs about 2^-8 of each group's largest
 * value, far more than the bf16 path's order of summation; tests bound it against the
 * dequantized layer. The AVX2 builds have their own version (its comment below), on the
 * rows as stored. Up to QUANT_INT8_MAX_ROWS rows of x (the decode steps, bound by
 * reading W); quant_linear.c's panels above.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_groups.h"
#include "weights.h"

#define BLOCK 16 /* groups per lane block */

/* rows rows of a Q4_0 / Q4_1 part in quant_groups.h's layout (src) into the lane order of
 * the file comment (dst), both [rows, row_bytes] with k values per row: each block of 16
 * groups rearranged, the rest (tail groups, scales, mins) copied. Plain C: it runs once per
 * weight at load, at memory speed. */
void quant_int8_repack(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t row_bytes, int64_t k) {
    const int64_t blocked_bytes = k / GROUP / BLOCK * 256;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *in = src + r * row_bytes;
        uint8_t *out = dst + r * row_bytes;
        memcpy(out + blocked_bytes, in + blocked_bytes, (size_t)(row_bytes - blocked_bytes));
        for (int64_t b = 0; b < blocked_bytes; b += 256)
            for (int g = 0; g < BLOCK; g++) {
                const uint8_t *pair = in + b + 32 * (g / 2); /* element e of group g: byte e, its g % 2 nibble */
                const int shift = 4 * (g % 2);
                for (int L = 0; L < 4; L++)
                    for (int i = 0; i < 4; i++) {
                        const int low = (pair[8 * L + i] >> shift) & 0x0F, high = (pair[8 * L + 4 + i] >> shift) & 0x0F;
                        out[b + 64 * L + 4 * g + i] = (uint8_t)(low | high << 4);
                    }
            }
    }
}

#define INT8_ROWS 8 /* rows of x per pass over a weight row */

/* x quantized: q[r * q_stride ...] the int8 values in the kernel's order, and per group
 * dx[r * group_stride + g] = dx, xsum[...] = dx * sum(q of the group). */
typedef struct {
    int8_t *q;
    float *dx, *xsum;
    int64_t q_stride, group_stride;
} QuantizedX;

static _Thread_local void *quantized_buffer;
static _Thread_local size_t quantized_capacity;

/* The buffer of m rows of x quantized, groups per row padded to a multiple of `align`. */
static QuantizedX quantized_x_buffer(int64_t m, int64_t k, int64_t align) {
    const int64_t padded = padded_groups(k);
    QuantizedX qx;
    qx.q_stride = 32 * padded;
    qx.group_stride = (padded + align - 1) / align * align;
    const size_t q_bytes = (size_t)(m * qx.q_stride + 63) / 64 * 64;
    char *buffer = grow_buffer(&quantized_buffer, &quantized_capacity,
                               q_bytes + 2 * sizeof(float) * (size_t)(m * qx.group_stride));
    qx.q = (int8_t *)buffer;
    qx.dx = (float *)(buffer + q_bytes);
    qx.xsum = qx.dx + m * qx.group_stride;
    return qx;
}

/* Row r's groups from `groups` on: zero values, scales and sums (the stored zero group of
 * an odd count, and the padding the vector loads of scales read). */
static void clear_tail_groups(const QuantizedX *qx, int64_t r, int64_t groups, int64_t padded) {
    for (int64_t g = groups; g < qx->group_stride; g++) {
        if (g < padded) memset(qx->q + r * qx->q_stride + 32 * g, 0, 32);
        qx->dx[r * qx->group_stride + g] = qx->xsum[r * qx->group_stride + g] = 0.0f;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define INT8_KERNEL 1
#define INT8_Q4_0 WEIGHT_Q4_0_VNNI
#define INT8_Q4_1 WEIGHT_Q4_1_VNNI
#define INT8_MXFP4 WEIGHT_MXFP4_VNNI

static QuantizedX quantize_x(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP, padded = padded_groups(k);
    const int64_t blocked = groups / BLOCK * BLOCK; /* groups in lane blocks; the rest in natural order */
    const QuantizedX qx = quantized_x_buffer(m, k, BLOCK);
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        int8_t *q = qx.q + r * qx.q_stride;
        float *dx = qx.dx + r * qx.group_stride, *xsum = qx.xsum + r * qx.group_stride;
        for (int64_t g = 0; g < groups; g++) {
            __m512i qlo, qhi;
            const float d = round_group_to_int8(row + 32 * g, &qlo, &qhi);
            int8_t values[32];
            _mm_storeu_si128((__m128i *)values, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(values + 16), _mm512_cvtsepi32_epi8(qhi));
            if (g < blocked) { /* elements 4R .. 4R + 3 to lane g % 16 of register R (the file comment) */
                int8_t *block = q + 32 * (g - g % BLOCK) + 4 * (g % BLOCK);
                for (int R = 0; R < 8; R++) memcpy(block + 64 * R, values + 4 * R, 4);
            } else {
                memcpy(q + 32 * g, values, 32);
            }
            dx[g] = d;
            xsum[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
        clear_tail_groups(&qx, r, groups, padded);
    }
    return qx;
}

/* NR weight rows against M (<= INT8_ROWS) quantized rows of x: result[j * M + r]. NR is 1,
 * or 2 for a single row of x, where the two rows' independent chains keep the vector units
 * busy and share each load of x (one row alone waits on its own latencies). One row of x
 * also splits its eight vpdpbusd per block into two chains (low and high nibbles). */
static inline __attribute__((always_inline)) void int8_rows(int type, int NR, int M, const QuantizedX *qx,
                                                            const uint8_t *const *rows, int64_t k, float *result) {
    const int64_t groups = k / GROUP, stored = padded_groups(k), blocked = groups / BLOCK * BLOCK;
    const uint16_t *d_half[2], *m_half[2];
    for (int j = 0; j < NR; j++) {
        d_half[j] = (const uint16_t *)(rows[j] + stored * 16);
        m_half[j] = d_half[j] + stored;
    }
    const int mx = type == WEIGHT_MXFP4_VNNI; /* codes looked up as twice their E2M1 value plus 12 */
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i codes = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)MXFP4_UNSIGNED_TABLE));
    __m512 acc[2][INT8_ROWS];
    __m256 tail[2][INT8_ROWS];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < M; r++) {
            acc[j][r] = _mm512_setzero_ps();
            tail[j][r] = _mm256_setzero_ps();
        }
    for (int64_t g0 = 0; g0 < groups; g0 += BLOCK) {
        const int count = groups - g0 < BLOCK ? (int)(groups - g0) : BLOCK;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        __m512 d16[2], min16[2];
        for (int j = 0; j < NR; j++) {
            d16[j] = mx ? e8m0_half16((const uint8_t *)d_half[j] + g0, mask)
                        : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d_half[j] + g0));
            min16[j] = type == WEIGHT_Q4_1_VNNI ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_half[j] + g0))
                                                : _mm512_mul_ps(d16[j], _mm512_set1_ps(mx ? -12.0f : -8.0f));
            for (int r = 0; r < M; r++) /* the offsets' term: sum over groups of m * dx * sum(xq) */
                acc[j][r] = _mm512_fmadd_ps(min16[j], _mm512_loadu_ps(qx->xsum + r * qx->group_stride + g0), acc[j][r]);
        }
        if (g0 < blocked) {
            __m512i low_sum[2][INT8_ROWS], high_sum[2][INT8_ROWS];
            for (int j = 0; j < NR; j++)
                for (int r = 0; r < M; r++) low_sum[j][r] = high_sum[j][r] = _mm512_setzero_si512();
            for (int L = 0; L < 4; L++) {
                __m512i low[2], high[2];
                for (int j = 0; j < NR; j++) {
                    const __m512i packed = _mm512_loadu_si512((const void *)(rows[j] + 16 * g0 + 64 * L));
                    low[j] = _mm512_and_si512(packed, low4);
                    high[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
                    if (mx) {
                        low[j] = _mm512_shuffle_epi8(codes, low[j]);
                        high[j] = _mm512_shuffle_epi8(codes, high[j]);
                    }
                }
                for (int r = 0; r < M; r++) {
                    const int8_t *xq = qx->q + r * qx->q_stride + 32 * g0 + 128 * L;
                    const __m512i x_low = _mm512_loadu_si512((const void *)xq);
                    const __m512i x_high = _mm512_loadu_si512((const void *)(xq + 64));
                    for (int j = 0; j < NR; j++) {
                        low_sum[j][r] = _mm512_dpbusd_epi32(low_sum[j][r], low[j], x_low);
                        if (M == 1)
                            high_sum[j][r] = _mm512_dpbusd_epi32(high_sum[j][r], high[j], x_high);
                        else /* several rows of x are chains enough */
                            low_sum[j][r] = _mm512_dpbusd_epi32(low_sum[j][r], high[j], x_high);
                    }
                }
            }
            for (int j = 0; j < NR; j++)
                for (int r = 0; r < M; r++) {
                    const __m512i sum = M == 1 ? _mm512_add_epi32(low_sum[j][r], high_sum[j][r]) : low_sum[j][r];
                    const __m512 ds = _mm512_mul_ps(d16[j], _mm512_loadu_ps(qx->dx + r * qx->group_stride + g0));
                    acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, acc[j][r]);
                }
            continue;
        }
        /* The tail: pairs of groups in natural order (an odd last group pairs with the
         * stored zero group, whose x is zero). */
        for (int j = 0; j < NR; j++) {
            float ds_buf[INT8_ROWS][16] __attribute__((aligned(64)));
            for (int r = 0; r < M; r++)
                _mm512_store_ps(ds_buf[r], _mm512_mul_ps(d16[j], _mm512_maskz_loadu_ps(mask, qx->dx + r * qx->group_stride + g0)));
            for (int t = 0; t < count; t += 2) {
                const int64_t group = g0 + t;
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(rows[j] + 16 * group));
                __m256i low = _mm256_and_si256(packed, _mm512_castsi512_si256(low4));
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm512_castsi512_si256(low4));
                if (mx) {
                    low = _mm256_shuffle_epi8(_mm512_castsi512_si256(codes), low);
                    high = _mm256_shuffle_epi8(_mm512_castsi512_si256(codes), high);
                }
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
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < M; r++)
            result[j * M + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][r], _mm512_castps256_ps512(tail[j][r])));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The AVX2 builds (avx2 and avx512 levels: Haswell to Ice Lake, Zen 1 to 3), which have
 * no VNNI instruction: vpmaddubsw multiplies 32 unsigned nibbles by 32 int8 values into 16
 * sums of two (at most 2 * 15 * 127, so no int16 saturation) and vpmaddwd by ones adds
 * those into 8 int32, converted and scaled once per group, as llama.cpp's AVX2 path.
 * quant_groups.h's pair layout is already the order this wants (one 32-byte load is two
 * groups' nibbles, each in element order), so the weights stay as stored and x is
 * quantized in its natural order. */
#define INT8_KERNEL 1
#define INT8_Q4_0 WEIGHT_Q4_0
#define INT8_Q4_1 WEIGHT_Q4_1
#define INT8_MXFP4 WEIGHT_MXFP4
#define SCALE_SPAN 8 /* groups whose scales are converted at once */

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline int hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* `count` (1..8) fp16 values as floats, zeros after them; a short last span reads a copy,
 * so that no load runs past the row. */
static inline __m256 scales8(const uint8_t *half, int count) {
    if (count == SCALE_SPAN) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)half));
    uint16_t bits[SCALE_SPAN] = {0};
    memcpy(bits, half, 2 * (size_t)count);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bits));
}

static QuantizedX quantize_x(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP, padded = padded_groups(k);
    const QuantizedX qx = quantized_x_buffer(m, k, SCALE_SPAN);
    const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    /* vpackssdw and vpacksswb interleave their sources by 128-bit lanes: this puts the
     * 32 bytes back in element order. */
    const __m256i lane_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        int8_t *q = qx.q + r * qx.q_stride;
        float *dx = qx.dx + r * qx.group_stride, *xsum = qx.xsum + r * qx.group_stride;
        for (int64_t g = 0; g < groups; g++) {
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                const __m128i words = _mm_loadu_si128((const __m128i *)(row + 32 * g + 8 * i));
                v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
                amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], sign_off));
            }
            const float top = hmax8(amax);
            const float d = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
            __m256i qi[4];
            for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            const __m256i words = _mm256_packs_epi32(qi[0], qi[1]), words_hi = _mm256_packs_epi32(qi[2], qi[3]);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words_hi), lane_order);
            _mm256_storeu_si256((__m256i *)(q + 32 * g), bytes);
            dx[g] = d;
            xsum[g] = d * (float)hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
        }
        clear_tail_groups(&qx, r, groups, padded);
    }
    return qx;
}

/* The accumulators of NR weight rows against M rows of x (int8_rows). */
typedef struct {
    __m256 even[2][INT8_ROWS], odd[2][INT8_ROWS];
} Int8Sums;

/* Groups g0 .. g0 + count - 1 (count <= SCALE_SPAN) into the sums. `count` is the constant
 * SCALE_SPAN in the main loop, so that loop calls nothing (a call would send every
 * accumulator through memory: no vector register survives one); only a short last span
 * copies its scales. */
static inline __attribute__((always_inline)) void int8_span(int type, int NR, int M, const QuantizedX *qx,
                                                            const uint8_t *const *rows, int64_t stored, int64_t g0,
                                                            int count, Int8Sums *sums) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i codes = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)MXFP4_UNSIGNED_TABLE));
    float ds[2][INT8_ROWS][SCALE_SPAN] __attribute__((aligned(32))); /* d * dx per group */
    for (int j = 0; j < NR; j++) {
        /* the fp16 scales (and mins) of these groups; MXFP4's exponent bytes (w = d u - 12 d) */
        const __m256 d8 = type == WEIGHT_MXFP4 ? e8m0_half8(rows[j] + stored * 16 + g0, count)
                                               : scales8(rows[j] + stored * 16 + 2 * g0, count);
        const __m256 min8 = type == WEIGHT_Q4_1 ? scales8(rows[j] + stored * 18 + 2 * g0, count)
                                                : _mm256_mul_ps(d8, _mm256_set1_ps(type == WEIGHT_MXFP4 ? -12.0f : -8.0f));
        for (int r = 0; r < M; r++) { /* the offsets' term: sum over groups of m * dx * sum(xq) */
            const int64_t at = r * qx->group_stride + g0;
            sums->even[j][r] = _mm256_fmadd_ps(min8, _mm256_loadu_ps(qx->xsum + at), sums->even[j][r]);
            _mm256_store_ps(ds[j][r], _mm256_mul_ps(d8, _mm256_loadu_ps(qx->dx + at)));
        }
    }
    /* pairs of groups; an odd last group pairs with the stored zero group (zero x and scale) */
    for (int t = 0; t < count; t += 2) {
        const int64_t group = g0 + t;
        __m256i low[2], high[2];
        for (int j = 0; j < NR; j++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(rows[j] + 16 * group));
            low[j] = _mm256_and_si256(packed, low4);
            high[j] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            if (type == WEIGHT_MXFP4) { /* each code as its doubled E2M1 value plus 12 (0 to 24) */
                low[j] = _mm256_shuffle_epi8(codes, low[j]);
                high[j] = _mm256_shuffle_epi8(codes, high[j]);
            }
        }
        for (int r = 0; r < M; r++) {
            const int8_t *xq = qx->q + r * qx->q_stride + 32 * group;
            const __m256i x_even = _mm256_loadu_si256((const __m256i *)xq);
            const __m256i x_odd = _mm256_loadu_si256((const __m256i *)(xq + 32));
            for (int j = 0; j < NR; j++) {
                const __m256i even = _mm256_madd_epi16(_mm256_maddubs_epi16(low[j], x_even), ones);
                const __m256i odd = _mm256_madd_epi16(_mm256_maddubs_epi16(high[j], x_odd), ones);
                sums->even[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(even), _mm256_set1_ps(ds[j][r][t]), sums->even[j][r]);
                const __m256 odd_scale = _mm256_set1_ps(ds[j][r][t + 1]); /* 0 past the last group */
                if (NR * M <= 4)
                    sums->odd[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd), odd_scale, sums->odd[j][r]);
                else /* more rows are chains enough (and registers are short) */
                    sums->even[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd), odd_scale, sums->even[j][r]);
            }
        }
    }
}

/* NR weight rows against M (<= INT8_ROWS) quantized rows of x: result[j * M + r]. NR is 1,
 * or 2 for a single row of x (two rows' independent chains share each load of x); up to 4
 * rows in all keep their even and odd groups in two accumulators, so that the
 * multiply-adds' latency is not the bound. */
static inline __attribute__((always_inline)) void int8_rows(int type, int NR, int M, const QuantizedX *qx,
                                                            const uint8_t *const *rows, int64_t k, float *result) {
    const int64_t groups = k / GROUP, stored = padded_groups(k), full = groups / SCALE_SPAN * SCALE_SPAN;
    Int8Sums sums;
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < M; r++) sums.even[j][r] = sums.odd[j][r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < full; g0 += SCALE_SPAN) int8_span(type, NR, M, qx, rows, stored, g0, SCALE_SPAN, &sums);
    if (full < groups) int8_span(type, NR, M, qx, rows, stored, full, (int)(groups - full), &sums);
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < M; r++) result[j * M + r] = hsum8(_mm256_add_ps(sums.even[j][r], sums.odd[j][r]));
}
#endif

#if defined(INT8_KERNEL)
int quant_int8_supported(int type) {
    return type == INT8_Q4_0 || type == INT8_Q4_1 || type == INT8_MXFP4 || quant_int8_k_supported(type) ||
           quant_int8_q8_supported(type);
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
INT8_KERNELS(INT8_Q4_0, int8_q4_0)
INT8_KERNELS(INT8_Q4_1, int8_q4_1)
INT8_KERNELS(INT8_MXFP4, int8_mxfp4)

/* Weight rows read ahead, whole, into L1 (as measured for this kernel's 1152-byte rows of a
 * 1B layer; the K-quant kernels' longer rows take quant_groups.h's stream_prefetch). */
#define INT8_PREFETCH_ROWS 4

static inline void prefetch_row(const uint8_t *row, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)row + offset, _MM_HINT_T0);
}

void quant_int8_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                            void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    if (quant_int8_k_supported(p->type)) { /* the K-quants: quant_int8_k.c */
        quant_int8_k_stream_part(x, x_stride, p, bias, out, out_stride, out_f32, m, k, t, nt);
        return;
    }
    if (quant_int8_q8_supported(p->type)) { /* Q8_0 on the VNNI builds: quant_int8_q8.c */
        quant_int8_q8_stream_part(x, x_stride, p, bias, out, out_stride, out_f32, m, k, t, nt);
        return;
    }
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    if (begin >= end) return;
    const QuantizedX qx = quantize_x(x, x_stride, m, k);
    const int q4_1 = p->type == INT8_Q4_1;
    const int8_fn *kernels = q4_1 ? int8_q4_1 : int8_q4_0;
    int8_fn pair_kernel = q4_1 ? int8_q4_1_2_1 : int8_q4_0_2_1;
    if (p->type == INT8_MXFP4) {
        kernels = int8_mxfp4;
        pair_kernel = int8_mxfp4_2_1;
    }
    float result[INT8_ROWS];
    int64_t n = begin;
    if (m == 1) /* two weight rows at a time (int8_rows' comment) */
        for (; n + 2 <= end; n += 2) {
            const uint8_t *rows[2] = {p->data + n * p->row_bytes, p->data + (n + 1) * p->row_bytes};
            if (n + INT8_PREFETCH_ROWS + 2 <= end) prefetch_row(rows[0] + INT8_PREFETCH_ROWS * p->row_bytes, 2 * p->row_bytes);
            pair_kernel(&qx, rows, k, result);
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
