/* Kernels, CPU: y = x W^T (+ b) computed in float32, for the builds without AVX-512 BF16
 * (build.py's levels avx2 and avx512: Haswell to Ice Lake, Zen 1 to 3).
 *
 * The same entry points as quant_linear.c (linear_weight_part, the dequantization), the
 * same weight formats, read as they are stored (quant_groups.h): a GGUF file stays
 * quantized in memory on these CPUs too. What differs is the arithmetic. Without a bf16
 * dot-product instruction, each group of 32 weights is dequantized in registers to
 * float32 (w = scale * u + min, one fused multiply-add) and multiplied into float32
 * activations (x, bf16 in memory, converted once per call) with fused multiply-adds;
 * float32 accumulation, one rounding at the end (none for a float32 output). Streamed (few
 * rows of x), the quantized types take integer multiply-adds instead (dot16_row): x's groups
 * as 16-bit integers times a power of two, exact for every value within 2^7 of its group's
 * largest (bf16 has 8 significant bits) and within 2^-15 of the largest for the rest, at
 * about half the instructions per weight.
 *
 * Two loops, as on the other builds (kernels/linear_choice.py measures which is faster
 * at each row count; LINEAR_BY_ROWS takes the constant below):
 * - streaming (by default up to F32_STREAMING_MAX_ROWS rows; the measured choice may take it
 *   further): each block of 16 weight rows is read from memory once per tile of x (about
 *   192 KiB of its 16-bit groups) and multiplied into 8 rows of x at a time while its groups
 *   are in registers (integer dot products with x's 16-bit groups, scaled once per group:
 *   dot16_row);
 * - GEMM (LINEAR_GEMM, and LINEAR_AMX, which this build does not have): a panel of W's
 *   rows is dequantized to float32 in a per-thread buffer that stays in L2, and 4 x 3
 *   blocks of dot products (12 accumulators) are computed from it.
 *
 * With int8 activations (LINEAR_STREAMING_INT8), Q4_0 / Q4_1 parts go to quant_int8.c's AVX2
 * kernel instead (x rounded to int8, byte multiply-adds) and x is not widened for them.
 *
 * The intrinsics are AVX2 + FMA + F16C; the avx512 build compiles the same code and lets
 * the compiler use the wider registers where it vectorizes on its own.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_groups.h"
#include "weights.h"

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#define F32_STREAM_ROWS 8
/* Up to this many rows the streaming loop is the default (the rule when no measured choice
 * is attached): above, a row of W would be decoded again for every 8 rows of x. */
#define F32_STREAMING_MAX_ROWS 8
static _Thread_local float *x_buffer;
static _Thread_local size_t x_capacity;
static _Thread_local void *groups_buffer;
static _Thread_local size_t groups_capacity;
static _Thread_local float *panel_buffer;
static _Thread_local size_t panel_capacity;

static inline __m256 bf16x8_to_float(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Eight floats rounded to bf16 (to nearest even, as float_to_bf16; the values are finite). */
static inline __m128i float_to_bf16x8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The mask that loads the first `count` (0..8) of eight floats. */
static inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* x [m, k] bf16 (row stride x_stride) as float32 [m, k]. */
static void x_to_float(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, float *out) {
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *src = x + r * x_stride;
        float *dst = out + r * k;
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) _mm256_storeu_ps(dst + i, bf16x8_to_float(src + i));
        for (; i < k; i++) dst[i] = bf16_to_float(src[i]);
    }
}

/* 32 integers as bytes (signed or not) -> four vectors of eight floats, in order. */
static inline __attribute__((always_inline)) void bytes_to_floats(__m256i bytes, int is_signed, __m256 f[4]) {
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    const __m128i quarters[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; j++)
        f[j] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(quarters[j]) : _mm256_cvtepu8_epi32(quarters[j]));
}

/* Group g (32 weights along k) of a quantized row as four vectors of float32 weights.
 * `type` is a constant where this is inlined, so each kernel keeps one branch. */
static inline __attribute__((always_inline)) void group_floats(int type, const uint8_t *row, int64_t g, int64_t k,
                                                               float row_scale, __m256 w[4]) {
    GroupScale gs;
    __m256i bytes;
    int is_signed = 0;
    if (type == WEIGHT_F16) { /* exact in float32 */
        for (int j = 0; j < 4; j++) w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 64 * g + 16 * j)));
        return;
    }
    if (type == WEIGHT_MXFP4) { /* signed codes, d = 2^(E - 128) (quant_groups.h) */
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(row + 32 * (g >> 1)));
        const __m256i codes = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)MXFP4_SIGNED_TABLE));
        bytes = _mm256_shuffle_epi8(codes, _mm256_and_si256((g & 1) ? _mm256_srli_epi16(packed, 4) : packed,
                                                            _mm256_set1_epi8(0x0F)));
        is_signed = 1;
        gs.scale_lo = gs.scale_hi = e8m0_half(row[padded_groups(k) * 16 + g]);
        gs.min_lo = gs.min_hi = 0.0f;
    } else if (type == WEIGHT_Q4_0 || type == WEIGHT_Q4_1) {
        const int64_t stored = padded_groups(k);
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(row + 32 * (g >> 1)));
        bytes = _mm256_and_si256((g & 1) ? _mm256_srli_epi16(packed, 4) : packed, _mm256_set1_epi8(0x0F));
        const uint8_t *d_half = row + stored * 16;
        gs.scale_lo = gs.scale_hi = half_to_float(d_half + 2 * g);
        gs.min_lo = gs.min_hi = type == WEIGHT_Q4_1 ? half_to_float(d_half + 2 * stored + 2 * g) : -8.0f * gs.scale_lo;
    } else if (type == WEIGHT_Q8_0 || type == WEIGHT_I8_ROW) {
        bytes = _mm256_loadu_si256((const __m256i *)(row + 32 * g));
        is_signed = 1;
        gs.scale_lo = gs.scale_hi = type == WEIGHT_Q8_0 ? half_to_float(row + k + 2 * g) : row_scale;
        gs.min_lo = gs.min_hi = 0.0f;
    } else {
        bytes = group_bytes(type, row, g, &gs);
        is_signed = group_bytes_signed(type);
    }
    __m256 f[4];
    bytes_to_floats(bytes, is_signed, f);
    const __m256 scale_lo = _mm256_set1_ps(gs.scale_lo), scale_hi = _mm256_set1_ps(gs.scale_hi);
    const __m256 min_lo = _mm256_set1_ps(gs.min_lo), min_hi = _mm256_set1_ps(gs.min_hi);
    w[0] = _mm256_fmadd_ps(f[0], scale_lo, min_lo);
    w[1] = _mm256_fmadd_ps(f[1], scale_lo, min_lo);
    w[2] = _mm256_fmadd_ps(f[2], scale_hi, min_hi);
    w[3] = _mm256_fmadd_ps(f[3], scale_hi, min_hi);
}

static inline int64_t group_sums_stride(int64_t k) { return (k / GROUP + 7) / 8 * 8; }

/* What dot16_row reads of x, computed once per call for all weight rows. Per row of x and
 * group of 32: the group's sum (the offsets' term: Q4_0's -8 d and Q4_1's min times it) and
 * the group as 16-bit integers times a power of two, 2^(e - 14) for the largest magnitude's
 * exponent e. x arrives as bf16 (8 significant bits), so every value within 2^7 of the
 * group's largest is exact as an integer, and smaller ones are rounded to 2^-15 of it: the
 * dot products are those of x as given, to that rounding, while the integer multiply-adds
 * take 16 weights per instruction. Per-row arrays are zero-padded to a multiple of 8 groups. */
typedef struct {
    float *sums;   /* [m, group_sums_stride(k)] */
    float *scales; /* [m, group_sums_stride(k)]: the power of two per group (0: all zeros) */
    int16_t *q;    /* [m, k] */
} XGroups;

/* A quiet NaN, from its bits (-ffast-math's constant folding is no place for NaN literals). */
static inline float nan_float(void) {
    const uint32_t bits = 0x7fc00000u;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static void x_groups(const float *x, int64_t m, int64_t k, XGroups *out) {
    const int64_t groups = k / GROUP, stride = group_sums_stride(k);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * k + g * GROUP;
            const __m256 v[4] = {_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8), _mm256_loadu_ps(xg + 16),
                                 _mm256_loadu_ps(xg + 24)};
            const float sum = sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
            out->sums[r * stride + g] = sum;
            const __m256 largest8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                                  _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
            __m128 largest = _mm_max_ps(_mm256_castps256_ps128(largest8), _mm256_extractf128_ps(largest8, 1));
            largest = _mm_max_ps(largest, _mm_movehl_ps(largest, largest));
            largest = _mm_max_ss(largest, _mm_movehdup_ps(largest));
            uint32_t bits;
            const float top = _mm_cvtss_f32(largest);
            memcpy(&bits, &top, sizeof bits);
            const int32_t exponent = (int32_t)(bits >> 23); /* biased; below 24 (|x| < 2^-103) counts as zero */
            int16_t *q = out->q + r * k + g * GROUP;
            /* An Inf or NaN in the group (the maximum may skip a NaN; the sum does not): the scale
             * carries a NaN into every product, so the output is not a finite guess. Tested on
             * the bits: -ffast-math lets the compiler assume no NaN in comparisons. */
            uint32_t sum_bits;
            memcpy(&sum_bits, &sum, sizeof sum_bits);
            const int not_finite = exponent == 255 || ((sum_bits >> 23) & 0xFF) == 0xFF;
            if (exponent < 24 || not_finite) {
                memset(q, 0, sizeof(int16_t) * GROUP);
                out->scales[r * stride + g] = not_finite ? nan_float() : 0.0f;
                continue;
            }
            const uint32_t scale_bits = (uint32_t)(exponent - 14) << 23, inverse_bits = (uint32_t)(268 - exponent) << 23;
            float scale, inverse;
            memcpy(&scale, &scale_bits, sizeof scale);
            memcpy(&inverse, &inverse_bits, sizeof inverse);
            out->scales[r * stride + g] = scale;
            const __m256 inv = _mm256_set1_ps(inverse);
            for (int h = 0; h < 2; h++) { /* 16 values: two vectors of int32, packed (the pack interleaves lanes) */
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h], inv));
                const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + 1], inv));
                _mm256_storeu_si256((__m256i *)(q + 16 * h), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
            }
        }
        for (int64_t g = groups; g < stride; g++) out->sums[r * stride + g] = out->scales[r * stride + g] = 0.0f;
    }
}

/* `count` (1..8) fp16 values as floats, zeros after them; a short last span reads a copy,
 * so that no load runs past the row. */
static inline __m256 halves8(const uint8_t *half, int count) {
    if (count == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)half));
    uint16_t bits[8] = {0};
    memcpy(bits, half, 2 * (size_t)count);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)bits));
}

/* Groups g0 .. g0 + count - 1 (count <= 8) of a Q4_0 / Q4_1 / MXFP4 / Q8_0 / int8 / Q4_K / Q5_K row
 * into the sums. Per group and row of x: the integer dot product of the weights' integers
 * with x's 16-bit integers (two vpmaddwd of 16 pairs, exact in int32 and in its float
 * conversion: at most 4 x 128 x 2^15 per lane), converted once and multiplied by the weight
 * scale times x's power of two. The offsets (Q4_0's -8 d, Q4_1's min, the K-quants' -dmin m)
 * are added once per 8 groups, times the groups' sums of x; the nibbles are taken as stored,
 * unsigned. One widening of 16 bytes to words
 * serves a Q4 pair's two groups: the low nibbles are group 2p's, the high ones group 2p + 1's
 * (quant_groups.h's pair layout). `count` is the constant 8 in the main loop, so that loop
 * calls nothing. */
static inline __attribute__((always_inline)) void dot16_span(int type, int M, const XGroups *xg, int64_t k,
                                                             const uint8_t *row, float row_scale, int64_t g0,
                                                             int count, __m256 even[], __m256 odd[]) {
    const int64_t stride = group_sums_stride(k);
    float scale[F32_STREAM_ROWS][8] __attribute__((aligned(32)));
    if (type == WEIGHT_Q8_0 || type == WEIGHT_I8_ROW) {
        const __m256 d8 = type == WEIGHT_Q8_0 ? halves8(row + k + 2 * g0, count) : _mm256_set1_ps(row_scale);
        for (int r = 0; r < M; r++) _mm256_store_ps(scale[r], _mm256_mul_ps(d8, _mm256_loadu_ps(xg->scales + r * stride + g0)));
        for (int t = 0; t < count; t++) {
            const int64_t group = g0 + t;
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 32 * group)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 32 * group + 16)));
            for (int r = 0; r < M; r++) {
                const __m256i *q = (const __m256i *)(xg->q + r * k + group * GROUP);
                const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(q)),
                                                     _mm256_madd_epi16(w1, _mm256_loadu_si256(q + 1)));
                __m256 *acc = (t & 1) && M <= 2 ? &odd[r] : &even[r]; /* two chains only where registers allow */
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[r][t]), *acc);
            }
        }
        return;
    }
    /* Q4_0 / Q4_1: the pairs of the repacked row; Q4_K / Q5_K: one super-block (g0 a multiple
     * of 8, count 8), whose 32-byte runs of nibbles are the same pairs, its 6-bit scales and
     * mins unpacked once for its 8 groups. */
    const uint8_t *pairs, *high_bits = NULL;
    __m256 d8, min8;
    if (type == WEIGHT_Q4_K || type == WEIGHT_Q5_K) {
        const uint8_t *block = row + g0 / 8 * (type == WEIGHT_Q4_K ? Q4_K_BLOCK_BYTES : Q5_K_BLOCK_BYTES);
        uint64_t scales, mins;
        k_scales_mins(block + 4, &scales, &mins);
        const uint32_t d_dmin_bits = load_u32(block);
        const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128((int32_t)d_dmin_bits)); /* d, dmin */
        d8 = _mm256_mul_ps(_mm256_broadcastss_ps(d_dmin),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scales))));
        min8 = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_sub_ps(_mm_setzero_ps(), _mm_movehdup_ps(d_dmin))),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mins))));
        pairs = block + (type == WEIGHT_Q4_K ? 16 : 48);
        if (type == WEIGHT_Q5_K) high_bits = block + 16; /* bit t of byte i: element i's fifth bit in group t */
    } else if (type == WEIGHT_MXFP4) { /* signed codes below: no offset */
        d8 = e8m0_half8(row + padded_groups(k) * 16 + g0, count);
        min8 = _mm256_setzero_ps();
        pairs = row + 16 * g0;
    } else {
        const int64_t stored = padded_groups(k);
        d8 = halves8(row + stored * 16 + 2 * g0, count);
        min8 = type == WEIGHT_Q4_1 ? halves8(row + stored * 18 + 2 * g0, count) : _mm256_mul_ps(d8, _mm256_set1_ps(-8.0f));
        pairs = row + 16 * g0;
    }
    for (int r = 0; r < M; r++) {
        even[r] = _mm256_fmadd_ps(min8, _mm256_loadu_ps(xg->sums + r * stride + g0), even[r]);
        _mm256_store_ps(scale[r], _mm256_mul_ps(d8, _mm256_loadu_ps(xg->scales + r * stride + g0)));
    }
    const __m256i low4 = _mm256_set1_epi16(0x0F), bit4 = _mm256_set1_epi16(0x10);
    __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
    if (high_bits != NULL) {
        h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)high_bits));
        h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(high_bits + 16)));
    }
    for (int t = 0; t < count; t += 2) {
        const int64_t group = g0 + t;
        const int pair = t + 1 < count; /* an odd last group has no partner */
        const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(pairs + 16 * t)));
        const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(pairs + 16 * t + 16)));
        __m256i lo0 = _mm256_and_si256(b0, low4), lo1 = _mm256_and_si256(b1, low4);
        __m256i hi0 = _mm256_srli_epi16(b0, 4), hi1 = _mm256_srli_epi16(b1, 4);
        if (type == WEIGHT_MXFP4) { /* each nibble as its signed code, looked up in bytes, then widened */
            const __m128i codes = _mm_load_si128((const __m128i *)MXFP4_SIGNED_TABLE), nibble = _mm_set1_epi8(0x0F);
            const __m128i r0 = _mm_loadu_si128((const __m128i *)(pairs + 16 * t));
            const __m128i r1 = _mm_loadu_si128((const __m128i *)(pairs + 16 * t + 16));
            lo0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(codes, _mm_and_si128(r0, nibble)));
            lo1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(codes, _mm_and_si128(r1, nibble)));
            hi0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(codes, _mm_and_si128(_mm_srli_epi16(r0, 4), nibble)));
            hi1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(codes, _mm_and_si128(_mm_srli_epi16(r1, 4), nibble)));
        }
        if (high_bits != NULL) { /* Q5_K: bit t (t + 1) moved to bit 4 */
            const __m128i low_shift = _mm_cvtsi32_si128(t), high_shift = _mm_cvtsi32_si128(t + 1);
            lo0 = _mm256_or_si256(lo0, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h0, low_shift), 4), bit4));
            lo1 = _mm256_or_si256(lo1, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h1, low_shift), 4), bit4));
            hi0 = _mm256_or_si256(hi0, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h0, high_shift), 4), bit4));
            hi1 = _mm256_or_si256(hi1, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(h1, high_shift), 4), bit4));
        }
        for (int r = 0; r < M; r++) {
            const __m256i *q = (const __m256i *)(xg->q + r * k + group * GROUP);
            const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(lo0, _mm256_loadu_si256(q)),
                                                _mm256_madd_epi16(lo1, _mm256_loadu_si256(q + 1)));
            even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_broadcast_ss(&scale[r][t]), even[r]);
            if (pair) {
                const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(hi0, _mm256_loadu_si256(q + 2)),
                                                    _mm256_madd_epi16(hi1, _mm256_loadu_si256(q + 3)));
                __m256 *acc = M <= 2 ? &odd[r] : &even[r];
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_broadcast_ss(&scale[r][t + 1]), *acc);
            }
        }
    }
}

/* One Q6_K super-block (groups g0 .. g0 + 7, g0 a multiple of 8) into the sums. Its 128
 * bytes of low nibbles are, per half of the super-block, two 32-byte runs whose low and high
 * nibbles are groups (t, t + 2); the 2-bit high parts of all four groups of a half share 32
 * bytes; every 16 values have their own int8 scale (scale 2t + e for half e of group t). The
 * values are u - 32 in -32..31, exact in words; per group and row two multiply-adds by
 * scale times x's power of two, one per 16 values. */
static inline __attribute__((always_inline)) void dot16_q6k_block(int M, const XGroups *xg, int64_t k,
                                                                  const uint8_t *row, int64_t g0,
                                                                  __m256 even[], __m256 odd[]) {
    const uint8_t *block = row + g0 / 8 * Q6_K_BLOCK_BYTES;
    const int64_t stride = group_sums_stride(k);
    const __m128i scale_bytes = _mm_loadu_si128((const __m128i *)(block + 192));
    const __m256 d = _mm256_set1_ps(half_to_float(block + 208));
    const __m256 scales_first = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scale_bytes)));
    const __m256 scales_second = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scale_bytes, 8))));
    float scale[F32_STREAM_ROWS][16] __attribute__((aligned(32)));
    for (int r = 0; r < M; r++) { /* x's power of two of group t for both its halves */
        const __m256 sx = _mm256_loadu_ps(xg->scales + r * stride + g0);
        _mm256_store_ps(scale[r], _mm256_mul_ps(scales_first, _mm256_permutevar8x32_ps(sx, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))));
        _mm256_store_ps(scale[r] + 8, _mm256_mul_ps(scales_second, _mm256_permutevar8x32_ps(sx, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))));
    }
    const __m256i low4 = _mm256_set1_epi16(0x0F), two_bits = _mm256_set1_epi16(3), offset = _mm256_set1_epi16(32);
    for (int half = 0; half < 2; half++) {
        const uint8_t *qh = block + 128 + 32 * half;
        const __m256i h0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qh));
        const __m256i h1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qh + 16)));
        for (int run = 0; run < 2; run++) {
            const uint8_t *ql = block + 64 * half + 32 * run;
            const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)ql));
            const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(ql + 16)));
            for (int nibble = 0; nibble < 2; nibble++) {
                const int t = 4 * half + run + 2 * nibble; /* the group within the super-block */
                const __m128i shift = _mm_cvtsi32_si128(2 * (run + 2 * nibble));
                const __m256i u0 = nibble ? _mm256_srli_epi16(b0, 4) : _mm256_and_si256(b0, low4);
                const __m256i u1 = nibble ? _mm256_srli_epi16(b1, 4) : _mm256_and_si256(b1, low4);
                const __m256i w0 = _mm256_sub_epi16(
                    _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, shift), two_bits), 4)), offset);
                const __m256i w1 = _mm256_sub_epi16(
                    _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, shift), two_bits), 4)), offset);
                for (int r = 0; r < M; r++) {
                    const __m256i *q = (const __m256i *)(xg->q + r * k + (g0 + t) * GROUP);
                    const __m256i first = _mm256_madd_epi16(w0, _mm256_loadu_si256(q));
                    const __m256i second = _mm256_madd_epi16(w1, _mm256_loadu_si256(q + 1));
                    even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_broadcast_ss(&scale[r][2 * t]), even[r]);
                    __m256 *acc = M <= 2 ? &odd[r] : &even[r];
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), _mm256_broadcast_ss(&scale[r][2 * t + 1]), *acc);
                }
            }
        }
    }
}

/* The types dot16_row reads; the others stream through stream_group_row. */
static inline int dot16_type(int type) {
    return type == WEIGHT_Q4_0 || type == WEIGHT_Q4_1 || type == WEIGHT_Q8_0 || type == WEIGHT_I8_ROW ||
           type == WEIGHT_MXFP4 || type == WEIGHT_Q4_K || type == WEIGHT_Q5_K || type == WEIGHT_Q6_K;
}

/* One row of any other type against M rows of float32 x: each group dequantized to float32
 * in registers (group_floats) and multiplied in, two accumulators per row. */
static inline __attribute__((always_inline)) void stream_group_row(int type, int M, const float *x, int64_t k,
                                                                   const uint8_t *row, float *result) {
    __m256 acc0[F32_STREAM_ROWS], acc1[F32_STREAM_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m256 w[4];
        group_floats(type, row, g, k, 1.0f, w);
        for (int r = 0; r < M; r++) {
            const float *xg = x + r * k + g * GROUP;
            acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg), w[0], acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), w[1], acc1[r]);
            acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w[2], acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w[3], acc1[r]);
        }
    }
    for (int r = 0; r < M; r++) result[r] = sum8(_mm256_add_ps(acc0[r], acc1[r]));
}

/* One Q4_0 / Q4_1 / Q8_0 / int8 / K-quant row against M (<= F32_STREAM_ROWS) rows of x:
 * result[r] = x[r] . w. */
static inline __attribute__((always_inline)) void dot16_row(int type, int M, const XGroups *xg, int64_t k,
                                                            const uint8_t *row, float row_scale, float *result) {
    const int64_t groups = k / GROUP, full = groups / 8 * 8;
    __m256 even[F32_STREAM_ROWS], odd[F32_STREAM_ROWS];
    for (int r = 0; r < M; r++) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < full; g0 += 8) {
        if (type == WEIGHT_Q6_K)
            dot16_q6k_block(M, xg, k, row, g0, even, odd);
        else
            dot16_span(type, M, xg, k, row, row_scale, g0, 8, even, odd);
    }
    if (full < groups) dot16_span(type, M, xg, k, row, row_scale, full, (int)(groups - full), even, odd);
    for (int r = 0; r < M; r++) result[r] = sum8(_mm256_add_ps(even[r], odd[r]));
}

/* The same for a bf16 weight row (any k: the last k % 8 columns are a masked load). */
static inline __attribute__((always_inline)) void stream_bf16_row(int M, const float *x, int64_t k,
                                                                  const uint16_t *w, float *result) {
    __m256 acc0[F32_STREAM_ROWS], acc1[F32_STREAM_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 w0 = bf16x8_to_float(w + i), w1 = bf16x8_to_float(w + i + 8);
        for (int r = 0; r < M; r++) {
            acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w0, acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i + 8), w1, acc1[r]);
        }
    }
    for (; i < k; i += 8) {
        const __m256i mask = first_lanes(k - i);
        uint16_t tail[8] = {0};
        memcpy(tail, w + i, sizeof(uint16_t) * (size_t)(k - i < 8 ? k - i : 8));
        const __m256 wv = bf16x8_to_float(tail);
        for (int r = 0; r < M; r++) acc0[r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * k + i, mask), wv, acc0[r]);
    }
    for (int r = 0; r < M; r++) result[r] = sum8(_mm256_add_ps(acc0[r], acc1[r]));
}

/* Weight rows [begin, end) of a part against M rows of float32 x (xg: the same rows' x_groups,
 * read by the dot16 types only), into out (+ bias); rows before prefetch_end are read ahead.
 * One call per block of weight rows, so the loop over them runs with M and the type fixed. */
typedef void (*stream_fn)(const float *x, const XGroups *xg, int64_t k, const WeightPart *p, int64_t begin,
                          int64_t end, int64_t prefetch_end, const uint16_t *bias, void *out, int64_t out_stride,
                          int out_f32);

#define STREAM_FN(NAME, TYPE, M)                                                                                 \
    static __attribute__((noinline)) void NAME##_##M(const float *x, const XGroups *xg, int64_t k,               \
                                                     const WeightPart *p, int64_t begin, int64_t end,            \
                                                     int64_t prefetch_end, const uint16_t *bias, void *out,      \
                                                     int64_t out_stride, int out_f32) {                          \
        float result[M];                                                                                         \
        for (int64_t n = begin; n < end; n++) {                                                                  \
            const uint8_t *row = p->data + n * p->row_bytes;                                                     \
            stream_prefetch(row, p->row_bytes, n, stream_prefetch_rows(p->row_bytes), prefetch_end);             \
            const float row_scale = p->row_scales ? p->row_scales[n] : 1.0f;                                     \
            if (TYPE == WEIGHT_BF16)                                                                             \
                stream_bf16_row(M, x, k, (const uint16_t *)row, result);                                         \
            else if (dot16_type(TYPE))                                                                           \
                dot16_row(TYPE, M, xg, k, row, row_scale, result);                                               \
            else                                                                                                 \
                stream_group_row(TYPE, M, x, k, row, result);                                                    \
            const float b = bias ? bf16_to_float(bias[n]) : 0.0f;                                                \
            for (int r = 0; r < M; r++) store_float(out, r * out_stride + n, result[r] + b, out_f32);            \
        }                                                                                                        \
    }
#define STREAM_KERNELS(NAME, TYPE)                                                                               \
    STREAM_FN(NAME, TYPE, 1) STREAM_FN(NAME, TYPE, 2) STREAM_FN(NAME, TYPE, 3) STREAM_FN(NAME, TYPE, 4)            \
    STREAM_FN(NAME, TYPE, 5) STREAM_FN(NAME, TYPE, 6) STREAM_FN(NAME, TYPE, 7) STREAM_FN(NAME, TYPE, 8)            \
    static const stream_fn NAME[F32_STREAM_ROWS + 1] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4,                \
                                                        NAME##_5, NAME##_6, NAME##_7, NAME##_8};

STREAM_KERNELS(stream_q4_0, WEIGHT_Q4_0)
STREAM_KERNELS(stream_q4_1, WEIGHT_Q4_1)
STREAM_KERNELS(stream_q8_0, WEIGHT_Q8_0)
STREAM_KERNELS(stream_mxfp4, WEIGHT_MXFP4)
STREAM_KERNELS(stream_q4_k, WEIGHT_Q4_K)
STREAM_KERNELS(stream_q5_k, WEIGHT_Q5_K)
STREAM_KERNELS(stream_q6_k, WEIGHT_Q6_K)
STREAM_KERNELS(stream_i8_row, WEIGHT_I8_ROW)
STREAM_KERNELS(stream_bf16, WEIGHT_BF16)
STREAM_KERNELS(stream_q5_0, WEIGHT_Q5_0)
STREAM_KERNELS(stream_q5_1, WEIGHT_Q5_1)
STREAM_KERNELS(stream_q2_k, WEIGHT_Q2_K)
STREAM_KERNELS(stream_q3_k, WEIGHT_Q3_K)
STREAM_KERNELS(stream_iq4_nl, WEIGHT_IQ4_NL)
STREAM_KERNELS(stream_iq4_xs, WEIGHT_IQ4_XS)
STREAM_KERNELS(stream_iq3_xxs, WEIGHT_IQ3_XXS)
STREAM_KERNELS(stream_iq3_s, WEIGHT_IQ3_S)
STREAM_KERNELS(stream_iq2_xxs, WEIGHT_IQ2_XXS)
STREAM_KERNELS(stream_iq2_xs, WEIGHT_IQ2_XS)
STREAM_KERNELS(stream_iq2_s, WEIGHT_IQ2_S)
STREAM_KERNELS(stream_iq1_s, WEIGHT_IQ1_S)
STREAM_KERNELS(stream_iq1_m, WEIGHT_IQ1_M)
STREAM_KERNELS(stream_tq1_0, WEIGHT_TQ1_0)
STREAM_KERNELS(stream_tq2_0, WEIGHT_TQ2_0)
STREAM_KERNELS(stream_f16, WEIGHT_F16)

/* Indexed like WEIGHT_TYPES. */
static const stream_fn *const STREAM_KERNELS_BY_TYPE[WEIGHT_TYPE_COUNT] = {
    [WEIGHT_INDEX_Q4_0] = stream_q4_0, [WEIGHT_INDEX_Q4_1] = stream_q4_1, [WEIGHT_INDEX_Q8_0] = stream_q8_0,
    [WEIGHT_INDEX_Q4_K] = stream_q4_k, [WEIGHT_INDEX_Q5_K] = stream_q5_k, [WEIGHT_INDEX_Q6_K] = stream_q6_k,
    [WEIGHT_INDEX_I8_ROW] = stream_i8_row, [WEIGHT_INDEX_BF16] = stream_bf16, [WEIGHT_INDEX_MXFP4] = stream_mxfp4,
    [WEIGHT_INDEX_Q5_0] = stream_q5_0, [WEIGHT_INDEX_Q5_1] = stream_q5_1, [WEIGHT_INDEX_Q2_K] = stream_q2_k,
    [WEIGHT_INDEX_Q3_K] = stream_q3_k, [WEIGHT_INDEX_IQ4_NL] = stream_iq4_nl, [WEIGHT_INDEX_IQ4_XS] = stream_iq4_xs,
    [WEIGHT_INDEX_IQ3_XXS] = stream_iq3_xxs, [WEIGHT_INDEX_IQ3_S] = stream_iq3_s,
    [WEIGHT_INDEX_IQ2_XXS] = stream_iq2_xxs, [WEIGHT_INDEX_IQ2_XS] = stream_iq2_xs, [WEIGHT_INDEX_IQ2_S] = stream_iq2_s,
    [WEIGHT_INDEX_IQ1_S] = stream_iq1_s, [WEIGHT_INDEX_IQ1_M] = stream_iq1_m, [WEIGHT_INDEX_TQ1_0] = stream_tq1_0,
    [WEIGHT_INDEX_TQ2_0] = stream_tq2_0, [WEIGHT_INDEX_F16] = stream_f16,
};

static const stream_fn *stream_kernels(int type) {
    const int index = weight_type_index(type);
    return index >= 0 && STREAM_KERNELS_BY_TYPE[index] ? STREAM_KERNELS_BY_TYPE[index] : stream_bf16;
}

/* Weight rows per call of a stream_fn: more than 8 rows of x take several calls per block,
 * which then reads its rows from L1 after the first. */
#define STREAM_BLOCK_ROWS 16

/* Thread t of nt's share of one part's output columns [begin, end), streaming. */
static void stream_part(const float *x, const XGroups *xg, const WeightPart *p, const uint16_t *bias, void *out,
                        int64_t out_stride, int out_f32, int64_t m, int64_t k, int64_t begin, int64_t end) {
    const stream_fn *kernels = stream_kernels(p->type);
    /* Rows of x per pass over the weights: about 192 KiB of x's 16-bit groups, so that they
     * stay in L2 while the weights stream by (at least one pass of 8 rows). */
    int64_t tile = (192 << 10) / (2 * k) / F32_STREAM_ROWS * F32_STREAM_ROWS;
    if (tile < F32_STREAM_ROWS) tile = F32_STREAM_ROWS;
    for (int64_t t0 = 0; t0 < m; t0 += tile) {
        const int64_t t1 = t0 + tile < m ? t0 + tile : m;
        for (int64_t n0 = begin; n0 < end; n0 += STREAM_BLOCK_ROWS) {
            const int64_t n1 = n0 + STREAM_BLOCK_ROWS < end ? n0 + STREAM_BLOCK_ROWS : end;
            for (int64_t first = t0; first < t1; first += F32_STREAM_ROWS) {
                const int rows = t1 - first < F32_STREAM_ROWS ? (int)(t1 - first) : F32_STREAM_ROWS;
                const int64_t at = first * group_sums_stride(k);
                const XGroups rows_xg = xg ? (XGroups){xg->sums + at, xg->scales + at, xg->q + first * k} : (XGroups){0};
                kernels[rows](x + first * k, &rows_xg, k, p, n0, n1, first == t0 ? end : 0, bias,
                              out_at(out, first * out_stride, out_f32), out_stride, out_f32);
            }
        }
    }
}

/* Rows [row0, row0 + count) of a part as float32 [count, k]. */
static void dequantize_float(const WeightPart *p, int64_t row0, int64_t count, int64_t k, float *out) {
    for (int64_t n = 0; n < count; n++) {
        const uint8_t *row = p->data + (row0 + n) * p->row_bytes;
        float *dst = out + n * k;
        if (p->type == WEIGHT_BF16) {
            x_to_float((const uint16_t *)row, 0, 1, k, dst);
            continue;
        }
        const float row_scale = p->row_scales ? p->row_scales[row0 + n] : 1.0f;
        for (int64_t g = 0; g < k / GROUP; g++) {
            __m256 w[4];
            switch (p->type) { /* one inlined decoder per type */
            case WEIGHT_Q4_0: group_floats(WEIGHT_Q4_0, row, g, k, row_scale, w); break;
            case WEIGHT_Q4_1: group_floats(WEIGHT_Q4_1, row, g, k, row_scale, w); break;
            case WEIGHT_Q8_0: group_floats(WEIGHT_Q8_0, row, g, k, row_scale, w); break;
            case WEIGHT_MXFP4: group_floats(WEIGHT_MXFP4, row, g, k, row_scale, w); break;
            case WEIGHT_Q4_K: group_floats(WEIGHT_Q4_K, row, g, k, row_scale, w); break;
            case WEIGHT_Q5_K: group_floats(WEIGHT_Q5_K, row, g, k, row_scale, w); break;
            case WEIGHT_Q6_K: group_floats(WEIGHT_Q6_K, row, g, k, row_scale, w); break;
            case WEIGHT_Q5_0: group_floats(WEIGHT_Q5_0, row, g, k, row_scale, w); break;
            case WEIGHT_Q5_1: group_floats(WEIGHT_Q5_1, row, g, k, row_scale, w); break;
            case WEIGHT_Q2_K: group_floats(WEIGHT_Q2_K, row, g, k, row_scale, w); break;
            case WEIGHT_Q3_K: group_floats(WEIGHT_Q3_K, row, g, k, row_scale, w); break;
            case WEIGHT_IQ4_NL: group_floats(WEIGHT_IQ4_NL, row, g, k, row_scale, w); break;
            case WEIGHT_IQ4_XS: group_floats(WEIGHT_IQ4_XS, row, g, k, row_scale, w); break;
            case WEIGHT_IQ3_XXS: group_floats(WEIGHT_IQ3_XXS, row, g, k, row_scale, w); break;
            case WEIGHT_IQ3_S: group_floats(WEIGHT_IQ3_S, row, g, k, row_scale, w); break;
            case WEIGHT_IQ2_XXS: group_floats(WEIGHT_IQ2_XXS, row, g, k, row_scale, w); break;
            case WEIGHT_IQ2_XS: group_floats(WEIGHT_IQ2_XS, row, g, k, row_scale, w); break;
            case WEIGHT_IQ2_S: group_floats(WEIGHT_IQ2_S, row, g, k, row_scale, w); break;
            case WEIGHT_IQ1_S: group_floats(WEIGHT_IQ1_S, row, g, k, row_scale, w); break;
            case WEIGHT_IQ1_M: group_floats(WEIGHT_IQ1_M, row, g, k, row_scale, w); break;
            case WEIGHT_TQ1_0: group_floats(WEIGHT_TQ1_0, row, g, k, row_scale, w); break;
            case WEIGHT_TQ2_0: group_floats(WEIGHT_TQ2_0, row, g, k, row_scale, w); break;
            case WEIGHT_F16: group_floats(WEIGHT_F16, row, g, k, row_scale, w); break;
            default: group_floats(WEIGHT_I8_ROW, row, g, k, row_scale, w); break;
            }
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(dst + g * GROUP + 8 * j, w[j]);
        }
    }
}

/* out[r][c] = x[r] . w[c] for 4 rows of x and 3 rows of w, all of length k (float32). */
static void dot_block_4x3(const float *const x[4], const float *const w[3], int64_t k, float out[4][3]) {
    __m256 acc[4][3];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 w0 = _mm256_loadu_ps(w[0] + i), w1 = _mm256_loadu_ps(w[1] + i), w2 = _mm256_loadu_ps(w[2] + i);
        for (int r = 0; r < 4; r++) {
            const __m256 xr = _mm256_loadu_ps(x[r] + i);
            acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(xr, w2, acc[r][2]);
        }
    }
    if (i < k) {
        const __m256i mask = first_lanes(k - i);
        const __m256 w0 = _mm256_maskload_ps(w[0] + i, mask), w1 = _mm256_maskload_ps(w[1] + i, mask);
        const __m256 w2 = _mm256_maskload_ps(w[2] + i, mask);
        for (int r = 0; r < 4; r++) {
            const __m256 xr = _mm256_maskload_ps(x[r] + i, mask);
            acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(xr, w2, acc[r][2]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++) out[r][c] = sum8(acc[r][c]);
}

/* Thread t of nt's share [begin, end) of one part's columns, a dequantized panel at a time. */
static void gemm_part(const float *x, const WeightPart *p, const uint16_t *bias, void *out, int64_t out_stride,
                      int out_f32, int64_t m, int64_t k, int64_t begin, int64_t end) {
    /* A panel of about 192 KB: it stays in L2 while every block of 4 rows of x passes it. */
    int64_t panel = (192 * 1024 / 4) / k;
    panel = panel < 3 ? 3 : (panel > 96 ? 96 : panel / 3 * 3);
    float *buffer = grow_buffer((void **)&panel_buffer, &panel_capacity, sizeof(float) * (size_t)(panel * k));
    float block[4][3];
    for (int64_t n0 = begin; n0 < end; n0 += panel) {
        const int64_t count = end - n0 < panel ? end - n0 : panel;
        dequantize_float(p, n0, count, k, buffer);
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int rows = m - r0 < 4 ? (int)(m - r0) : 4;
            const float *xs[4];
            for (int r = 0; r < 4; r++) xs[r] = x + (r0 + (r < rows ? r : rows - 1)) * k; /* short blocks repeat a row */
            for (int64_t c0 = 0; c0 < count; c0 += 3) {
                const int cols = count - c0 < 3 ? (int)(count - c0) : 3;
                const float *ws[3];
                for (int c = 0; c < 3; c++) ws[c] = buffer + (c0 + (c < cols ? c : cols - 1)) * k;
                dot_block_4x3(xs, ws, k, block);
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < cols; c++) {
                        const int64_t n = n0 + c0 + c;
                        store_float(out, (r0 + r) * out_stride + n, block[r][c] + (bias ? bf16_to_float(bias[n]) : 0.0f),
                                    out_f32);
                    }
            }
        }
    }
}

void linear_weight_part(const uint16_t *x, int64_t x_stride, const Weight *w, const uint16_t *bias, void *out,
                        int64_t out_stride, int out_f32, int64_t m, int64_t k, int impl, int t, int nt) {
    float *xf = NULL; /* x in float32, converted once if a part needs it */
    XGroups groups = {0}; /* x_groups, once if a part streams through dot16_row */
    const int stream = impl_streams(impl) || (impl == LINEAR_BY_ROWS && m <= F32_STREAMING_MAX_ROWS);
    int64_t offset = 0;
    for (int i = 0; i < w->num_parts; i++) {
        const WeightPart *p = &w->parts[i];
        int64_t begin, end;
        thread_share(p->rows, 16, t, nt, &begin, &end);
        if (begin < end) {
            const uint16_t *part_bias = bias ? bias + offset : NULL;
            void *part_out = out_at(out, offset, out_f32);
            if (impl == LINEAR_STREAMING_INT8 && quant_int8_supported(p->type)) {
                quant_int8_stream_part(x, x_stride, p, part_bias, part_out, out_stride, out_f32, m, k, t, nt);
                offset += p->rows;
                continue;
            }
            if (xf == NULL) {
                xf = grow_buffer((void **)&x_buffer, &x_capacity, sizeof(float) * (size_t)(m * k));
                x_to_float(x, x_stride, m, k, xf);
            }
            if (stream && groups.q == NULL && dot16_type(p->type)) {
                const size_t per_row = sizeof(float) * 2 * (size_t)group_sums_stride(k) + sizeof(int16_t) * (size_t)k;
                char *buffer = grow_buffer((void **)&groups_buffer, &groups_capacity, per_row * (size_t)m);
                groups.sums = (float *)buffer;
                groups.scales = groups.sums + m * group_sums_stride(k);
                groups.q = (int16_t *)(groups.scales + m * group_sums_stride(k));
                x_groups(xf, m, k, &groups);
            }
            if (stream)
                stream_part(xf, groups.q ? &groups : NULL, p, part_bias, part_out, out_stride, out_f32, m, k, begin, end);
            else
                gemm_part(xf, p, part_bias, part_out, out_stride, out_f32, m, k, begin, end);
        }
        offset += p->rows;
    }
}

int quant_type_supported(int type) { return weight_row_bytes(type, 256) > 0 && type != WEIGHT_BF16; }

void dequantize_rows_bf16(const WeightPart *p, int64_t row0, int64_t count, int64_t k, uint16_t *out) {
    if (p->type == WEIGHT_BF16) {
        memcpy(out, p->data + row0 * p->row_bytes, (size_t)(count * k * 2));
        return;
    }
    float *row = grow_buffer((void **)&panel_buffer, &panel_capacity, sizeof(float) * (size_t)k);
    for (int64_t n = 0; n < count; n++) {
        dequantize_float(p, row0 + n, 1, k, row);
        for (int64_t i = 0; i < k; i += 8) _mm_storeu_si128((__m128i *)(out + n * k + i), float_to_bf16x8(_mm256_loadu_ps(row + i)));
    }
}

void gather_rows_bf16(const WeightPart *p, const int64_t *ids, int64_t count, int64_t k, uint16_t *out) {
    for (int64_t i = 0; i < count; i++) dequantize_rows_bf16(p, ids[i], 1, k, out + i * k);
}
#endif
