/* Kernels, CPU: reading the quantized weight formats of weights.h, 32 weights (a group)
 * at a time, for every kernel build (AVX2 and up; quant_linear.c multiplies the groups
 * with AVX-512 BF16, linear_f32.c in float32).
 *
 * Every supported type is, per group of 32 weights along k, small integers u with a scale
 * and an offset: w = scale * u + min (Q6_K has two scales per group, one per 16).
 *
 * Q4_0 and Q4_1 rows are repacked at load (kernels/weights.py, pack_rows): the nibbles of
 * groups 2p and 2p + 1 share 32 bytes (group 2p in the low nibbles, in element order, 2p + 1
 * in the high ones), followed by the row's fp16 scales d[groups] (and, Q4_1, mins
 * m[groups]); an odd group count is padded with a zero group. Q8_0 rows are the int8
 * values of all groups followed by d[groups]. The same bytes as the file's blocks, laid
 * out so that a 32-byte load feeds two groups and the scales of 16 groups convert at once.
 * The K-quants are read in the file's own layout.
 *
 * MXFP4 (gpt-oss's experts) is row-packed as Q4_0 is, its one-byte E8M0 exponents in place
 * of the fp16 scales. Its 4-bit codes are E2M1 numbers, not integers: sign, two exponent
 * bits e, one mantissa bit m, worth m / 2 for e = 0 and 2^(e - 1) (1 + m / 2) above. Twice
 * that is an integer, MXFP4_CODES below, so a group is d * code with d = 2^(E - 128) (the
 * exponent E's 2^(E - 127), halved for the doubling).
 */
#ifndef PAGELLM_QUANT_GROUPS_H
#define PAGELLM_QUANT_GROUPS_H

#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "weights.h"

#define GROUP 32

static inline float half_to_float(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

static inline int64_t padded_groups(int64_t k) { return (k / 32 + 1) / 2 * 2; }

static inline int is_row_packed(int type) {
    return type == WEIGHT_Q4_0 || type == WEIGHT_Q4_1 || type == WEIGHT_Q8_0 || type == WEIGHT_MXFP4;
}

/* Twice the E2M1 value of each 4-bit code (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6 doubled. */
#define MXFP4_CODES 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
/* The same plus 12, 0 to 24: an unsigned integer for the kernels that take groups as u >= 0
 * (w = d u - 12 d). */
#define MXFP4_UNSIGNED_CODES 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
static const int8_t MXFP4_SIGNED_TABLE[16] __attribute__((aligned(16))) = {MXFP4_CODES};
static const uint8_t MXFP4_UNSIGNED_TABLE[16] __attribute__((aligned(16))) = {MXFP4_UNSIGNED_CODES};
static const float MXFP4_FLOAT_TABLE[16] __attribute__((aligned(64))) = {MXFP4_CODES};

/* d = 2^(E - 128) of an E8M0 exponent byte (GGML's reading: E < 2 gives the subnormal 2^-128
 * or 2^-127, which the kernels' flush-to-zero mode reads as 0 anyway). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* 8 exponent bytes as their d (as e8m0_half), for the AVX2 loops. */
static inline __m256 e8m0_half8(const uint8_t *e, int count) {
    uint8_t bytes[8] = {0};
    memcpy(bytes, e, (size_t)count);
    int64_t packed;
    memcpy(&packed, bytes, 8);
    const __m256i exponent = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(packed));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(exponent, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), exponent);
    const __m256i is_tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), exponent);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, is_tiny));
}

/* The scale and offset of a group: w = scale * u + min for its first 16 elements (lo) and
 * its last 16 (hi). */
typedef struct {
    float scale_lo, scale_hi, min_lo, min_hi;
} GroupScale;

/* 6-bit scale and min j of a Q4_K / Q5_K super-block (GGML's packing of 12 bytes). */
static inline void k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Group g of a K-quant row (Q4_K, Q5_K, Q6_K): its 32 unsigned integers u as bytes, and
 * its scales. `type` is a constant where this is inlined, so each kernel keeps one branch. */
static inline __attribute__((always_inline)) __m256i k_group_bytes(int type, const uint8_t *row, int64_t g,
                                                                   GroupScale *gs) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == WEIGHT_Q6_K) {
        const int64_t sub = g & 7, half = sub >> 2, i = sub & 3;
        const uint8_t *block = row + (g >> 3) * Q6_K_BLOCK_BYTES;
        const uint8_t *ql = block + 64 * half, *qh = block + 128 + 32 * half;
        const int8_t *scales = (const int8_t *)(block + 192) + 8 * half;
        const float d = half_to_float(block + 208);
        __m256i packed = _mm256_loadu_si256((const __m256i *)(ql + 32 * (i & 1)));
        __m256i u = _mm256_and_si256(i >= 2 ? _mm256_srli_epi16(packed, 4) : packed, low4);
        __m256i high = _mm256_loadu_si256((const __m256i *)qh);
        high = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi64_si128(2 * i)), _mm256_set1_epi8(3));
        gs->scale_lo = d * (float)scales[2 * i];
        gs->scale_hi = d * (float)scales[2 * i + 1];
        gs->min_lo = -32.0f * gs->scale_lo; /* u - 32 */
        gs->min_hi = -32.0f * gs->scale_hi;
        return _mm256_or_si256(u, _mm256_slli_epi16(high, 4));
    }
    const int64_t sub = g & 7;
    const uint8_t *block = row + (g >> 3) * (type == WEIGHT_Q4_K ? Q4_K_BLOCK_BYTES : Q5_K_BLOCK_BYTES);
    int sc, mn;
    k_scale_min(block + 4, (int)sub, &sc, &mn);
    gs->scale_lo = gs->scale_hi = half_to_float(block) * (float)sc;
    gs->min_lo = gs->min_hi = -half_to_float(block + 2) * (float)mn;
    const uint8_t *qs = block + (type == WEIGHT_Q4_K ? 16 : 48) + 32 * (sub >> 1);
    __m256i packed = _mm256_loadu_si256((const __m256i *)qs);
    __m256i u = _mm256_and_si256((sub & 1) ? _mm256_srli_epi16(packed, 4) : packed, low4);
    if (type == WEIGHT_Q5_K) {
        __m256i high = _mm256_loadu_si256((const __m256i *)(block + 16));
        high = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi64_si128(sub)), _mm256_set1_epi8(1));
        u = _mm256_or_si256(u, _mm256_slli_epi16(high, 4));
    }
    return u;
}

#endif
