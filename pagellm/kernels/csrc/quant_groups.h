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
    return type == WEIGHT_Q4_0 || type == WEIGHT_Q4_1 || type == WEIGHT_Q8_0;
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
