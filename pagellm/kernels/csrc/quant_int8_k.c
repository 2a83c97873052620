/* Kernels, CPU: y = x W^T for the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), IQ4_XS and IQ3_S as stored, with x
 * rounded to int8 per 32 values (the opt-in int8-activation path,
 * EngineArgs.int8_activations; quant_int8.c serves Q4_0 / Q4_1). AVX-512 VNNI builds only:
 * the AVX2 builds stream these types with bf16 activations.
 *
 * The weights stay in llama.cpp's super-block layout. Each super-block of 256 weights is
 * decoded in registers into four vectors of 64 small unsigned integers u (k_decode), a
 * scale and an offset per 16 weights (w = scale u + offset), and x is rounded into the
 * order those vectors hold: one vpdpbusd multiplies 64 of them by 64 int8 values into 16
 * int32 lanes, each the sum of four products within one 16-weight sub-block. Per row of x
 * and super-block: four vpdpbusd, four conversions, four permutes of the sub-blocks'
 * scale x dx and four multiply-adds, and the offsets' term sum_s offset_s dx sum(xq_s) as
 * one vector product over the 16 sub-blocks (x's sums per 16 values).
 *  - Q2_K, Q3_K, Q6_K: the 2-bit planes (and Q3_K's high bits, Q6_K's two planes of qh)
 *    of 32 bytes are 128 weights in element order, so x keeps its natural order.
 *  - Q4_K, Q5_K: 32 bytes of nibbles hold groups 2p (low) and 2p + 1 (high), so one load of
 *    64 bytes is groups a, b, c, d with a and c in the low nibbles; x is rounded with the
 *    groups of each run of four in the order a, c, b, d (Q5_K's fifth bits join from qh).
 *  - IQ4_XS: 16 bytes per group, low nibbles its values 0-15, high ones 16-31, looked up in
 *    IQ4's table plus 128 (unsigned bytes; the offset -128 scale takes the 128 back); x holds
 *    values 0-15 of each run of four groups, then values 16-31.
 *  - IQ3_S: each 4 weights' magnitudes (odd, 1-15) one codebook entry of 512, looked up 32
 *    at a time in registers as 16-bit words (iq3s_lookup; the index's ninth bit from qh); the
 *    sign bits (one per weight, in element order) turn each into 16 + signed value (1-31),
 *    the offset -16 scale taking the 16 back; x in its natural order. The bf16 path gathers
 *    8 entries at a time and widens each weight to bf16.
 * The bf16 path spends eight byte unpackings and eight bf16 dot products per 256 weights.
 * Precision as quant_int8.c: x rounded to int8 costs about 2^-8 of each group's largest
 * value; tests bound it.
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
#define K_RUN 16 /* weight rows per kernel call */

/* x rounded: q[r * k ...] the int8 values in the weight type's order; per group of 32,
 * dx[r * groups + g] = max |x| / 127; per 16 values, xsum16[r * 2 groups + s] = dx * sum(q)
 * over those 16. */
typedef struct {
    int8_t *q;
    float *dx, *xsum16;
    int64_t groups;
} KQuantizedX;

static _Thread_local void *k_buffer;
static _Thread_local size_t k_capacity;

static inline int pair_order(int type) { return type == WEIGHT_Q4_K || type == WEIGHT_Q5_K; }
static inline int half_order(int type) { return type == WEIGHT_IQ4_XS; }

/* The slot of group g within its run of four: a, c, b, d for the pair-order types. */
static inline int64_t pair_slot(int64_t g) {
    const int64_t i = g & 3;
    return (g & ~(int64_t)3) + (i == 1 ? 2 : i == 2 ? 1 : i);
}

static KQuantizedX quantize_x_k(int type, const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    KQuantizedX qx;
    qx.groups = k / GROUP;
    const size_t q_bytes = (size_t)(m * k + 63) / 64 * 64;
    char *buffer = grow_buffer(&k_buffer, &k_capacity, q_bytes + 3 * sizeof(float) * (size_t)(m * qx.groups));
    qx.q = (int8_t *)buffer;
    qx.dx = (float *)(buffer + q_bytes);
    qx.xsum16 = qx.dx + m * qx.groups;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * x_stride;
        for (int64_t g = 0; g < qx.groups; g++) {
            __m512i qlo, qhi;
            const float d = round_group_to_int8(row + 32 * g, &qlo, &qhi);
            /* where values 0-15 and 16-31 of the group go (file comment) */
            int8_t *first = qx.q + r * k + 32 * (pair_order(type) ? pair_slot(g) : g), *second = first + 16;
            if (half_order(type)) {
                first = qx.q + r * k + 128 * (g >> 2) + 16 * (g & 3);
                second = first + 64;
            }
            _mm_storeu_si128((__m128i *)first, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)second, _mm512_cvtsepi32_epi8(qhi));
            qx.dx[r * qx.groups + g] = d;
            qx.xsum16[2 * (r * qx.groups + g)] = d * (float)_mm512_reduce_add_epi32(qlo);
            qx.xsum16[2 * (r * qx.groups + g) + 1] = d * (float)_mm512_reduce_add_epi32(qhi);
        }
    }
    return qx;
}

/* A super-block decoded: four vectors of 64 unsigned integers in x's order for the type,
 * and per 16 weights (in element order) w = scale16 u + offset16. */
typedef struct {
    __m512i values[4];
    __m512 scale16, offset16;
} KBlock;

/* 16 bit fields of 32 bytes broadcast to both halves of a vector: bits shift (first 32
 * bytes) and shift + step (next 32) of each byte, masked to `mask`. Shifts stay below 8, so
 * a 16-bit shift brings nothing of the next byte under the mask. */
static inline __m512i bit_fields(__m256i bytes, int shift, int step, int mask) {
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16((short)shift), _mm256_set1_epi16((short)(shift + step)), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(bytes), shifts), _mm512_set1_epi8((char)mask));
}

/* Bit `shift` (first 32 bytes) and bit shift + step (next 32) of each of 32 bytes, as a
 * mask over 64 byte lanes: a single high bit joins its 2- or 4-bit value by one masked add
 * (a shift, a mask, a shift and an or as bit_fields). */
static inline __mmask64 bit_mask(__m256i bytes, int shift, int step) {
    const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << shift)), _mm256_set1_epi8((char)(1 << (shift + step))), 1);
    return _mm512_test_epi8_mask(_mm512_broadcast_i64x4(bytes), bits);
}

/* Per-32 scales and mins (8 bytes each) as per-16 floats: d sc, -dmin m. */
static inline void k_scales16(const uint8_t *block, KBlock *kb) {
    uint64_t scales, mins;
    k_scales_mins(block + 4, &scales, &mins);
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scales)));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mins)));
    kb->scale16 = _mm512_permutexvar_ps(twice, _mm512_mul_ps(_mm512_set1_ps(half_to_float(block)), sc));
    kb->offset16 = _mm512_permutexvar_ps(twice, _mm512_mul_ps(_mm512_set1_ps(-half_to_float(block + 2)), mn));
}

/* IQ4_XS's 8 scales d (ls - 32), ls 6 bits: low nibbles from bytes 4-7, top 2 bits from
 * the 16-bit word at byte 2; as per-16 floats. */
static inline __m512 iq4_xs_scales16(const uint8_t *block) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i low4 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(block + 4)), _mm256_slli_epi32(index, 2)),
                                          _mm256_set1_epi32(15));
    const __m256i high2 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(load_u16(block + 2)), _mm256_slli_epi32(index, 1)),
                                           _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(low4, _mm256_slli_epi32(high2, 4)), _mm256_set1_epi32(32));
    const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(half_to_float(block)), _mm256_cvtepi32_ps(ls));
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(scales));
}

/* IQ3_S's entries for 32 9-bit indices (16-bit lanes) as quant_iq3s_words' words: eight
 * two-register lookups of 64 entries (index bits 0-5), joined by bits 6, 7 and 8. The
 * 16-entry gathers this replaced took about 2 cycles an entry on Zen 4 (AMD EPYC), most of
 * the kernel's time. */
static inline __m512i iq3s_lookup(__m512i index) {
    const __m512i *table = (const __m512i *)quant_iq3s_words;
    __m512i level[8];
    for (int s = 0; s < 8; s++)
        level[s] = _mm512_permutex2var_epi16(_mm512_load_si512(table + 2 * s), index, _mm512_load_si512(table + 2 * s + 1));
    for (int bit = 0, count = 8; count > 1; bit++, count /= 2) {
        const __mmask32 upper = _mm512_test_epi16_mask(index, _mm512_set1_epi16((short)(64 << bit)));
        for (int s = 0; s < count / 2; s++) level[s] = _mm512_mask_blend_epi16(upper, level[2 * s], level[2 * s + 1]);
    }
    return level[0];
}

/* `iq4_table`: IQ4's 16 signed values plus 128 (unsigned bytes) in every 128-bit lane. */
static inline __attribute__((always_inline)) void k_decode(int type, const uint8_t *block, __m512i iq4_table, KBlock *kb) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if (type == WEIGHT_IQ4_XS) { /* d, scales_h, scales_l 4, qs 128: group g's 16 bytes, low nibbles its values 0-15 */
        kb->scale16 = iq4_xs_scales16(block);
        kb->offset16 = _mm512_mul_ps(kb->scale16, _mm512_set1_ps(-128.0f));
        for (int run = 0; run < 2; run++) {
            const __m512i packed = _mm512_loadu_si512((const void *)(block + 8 + 64 * run));
            kb->values[2 * run] = _mm512_shuffle_epi8(iq4_table, _mm512_and_si512(packed, low4));
            kb->values[2 * run + 1] = _mm512_shuffle_epi8(iq4_table, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4));
        }
    } else if (type == WEIGHT_Q4_K || type == WEIGHT_Q5_K) {
        k_scales16(block, kb);
        const uint8_t *qs = block + (type == WEIGHT_Q5_K ? 48 : 16);
        const __m256i qh = type == WEIGHT_Q5_K ? _mm256_loadu_si256((const __m256i *)(block + 16)) : _mm256_setzero_si256();
        for (int run = 0; run < 2; run++) {
            const __m512i packed = _mm512_loadu_si512((const void *)(qs + 64 * run));
            kb->values[2 * run] = _mm512_and_si512(packed, low4);
            kb->values[2 * run + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
            if (type == WEIGHT_Q5_K) { /* group g's fifth bits: bit g of qh's 32 bytes */
                const __m512i sixteen = _mm512_set1_epi8(16);
                kb->values[2 * run] = _mm512_mask_add_epi8(kb->values[2 * run], bit_mask(qh, 4 * run, 2), kb->values[2 * run], sixteen);
                kb->values[2 * run + 1] =
                    _mm512_mask_add_epi8(kb->values[2 * run + 1], bit_mask(qh, 4 * run + 1, 2), kb->values[2 * run + 1], sixteen);
            }
        }
    } else if (type == WEIGHT_Q6_K) { /* ql 128, qh 64, scales 16 int8, d */
        const __m512 d16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))));
        kb->scale16 = d16;
        kb->offset16 = _mm512_mul_ps(d16, _mm512_set1_ps(-32.0f));
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(block + 64 * h));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
            kb->values[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(bit_fields(qh, 0, 2, 3), 4));
            kb->values[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                                    _mm512_slli_epi16(bit_fields(qh, 4, 2, 3), 4));
        }
    } else if (type == WEIGHT_Q3_K) { /* hmask 32, qs 64, scales 12, d: u = q + 4 h, w = d sc (u - 4) */
        const __m512 d16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block + 108)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3_k_scales(block + 96))));
        kb->scale16 = d16;
        kb->offset16 = _mm512_mul_ps(d16, _mm512_set1_ps(-4.0f));
        const __m256i hmask = _mm256_loadu_si256((const __m256i *)block);
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * h));
            for (int j = 0; j < 2; j++) {
                const __m512i low = bit_fields(qs, 4 * j, 2, 3);
                kb->values[2 * h + j] = _mm512_mask_add_epi8(low, bit_mask(hmask, 4 * h + 2 * j, 1), low, _mm512_set1_epi8(4));
            }
        }
    } else if (type == WEIGHT_IQ3_S) { /* d, qs 64, qh 8, signs 32, scales 4: w = d (1 + 2 s) sign grid[index] */
        /* per 32 weights one 4-bit scale (duplicated for its two 16s); the magnitudes (odd,
         * 1 to 15) with their signs held as 16 + signed value (1 to 31), the offset -16 taking the 16 back */
        const __m256i group = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i s4 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(block + 106)), _mm256_slli_epi32(group, 2)),
                                            _mm256_set1_epi32(15));
        const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(half_to_float(block)),
                                            _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(s4, s4), _mm256_set1_epi32(1))));
        const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        kb->scale16 = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(scales));
        kb->offset16 = _mm512_mul_ps(kb->scale16, _mm512_set1_ps(-16.0f));
        const __m512i sixteen = _mm512_set1_epi8(16);
        uint64_t high_bits; /* the ninth bit of entry e: bit e of qh */
        memcpy(&high_bits, block + 66, 8);
        for (int half = 0; half < 2; half++) { /* entries 32 half .. + 31: weights 128 half .. + 127 */
            __m512i index = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 2 + 32 * half)));
            index = _mm512_mask_add_epi16(index, _cvtu32_mask32((uint32_t)(high_bits >> (32 * half))), index, _mm512_set1_epi16(256));
            const __m512i words = iq3s_lookup(index);
            for (int q = 0; q < 2; q++) { /* entries 16 i .. + 15: weights 64 i .. + 63 */
                const int i = 2 * half + q;
                const __m512i entry = _mm512_cvtepu16_epi32(q ? _mm512_extracti64x4_epi64(words, 1) : _mm512_castsi512_si256(words));
                /* the word's nibbles m0 | m2 << 4 | m1 << 8 | m3 << 12 (codebooks.c) as bytes m0, m1, m2, m3 */
                const __m512i magnitude = _mm512_ternarylogic_epi32(entry, _mm512_slli_epi32(entry, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
                uint64_t sign_bits;
                memcpy(&sign_bits, block + 74 + 8 * i, 8);
                kb->values[i] = _mm512_mask_sub_epi8(_mm512_add_epi8(sixteen, magnitude), _cvtu64_mask64(sign_bits), sixteen, magnitude);
            }
        }
    } else { /* Q2_K: scales 16 (low nibble scale, high nibble min), qs 64, d, dmin */
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)block));
        kb->scale16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block + 80)),
                                    _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15))));
        kb->offset16 = _mm512_mul_ps(_mm512_set1_ps(-half_to_float(block + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)));
        for (int h = 0; h < 2; h++) {
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * h));
            for (int j = 0; j < 2; j++) kb->values[2 * h + j] = bit_fields(qs, 4 * j, 2, 3);
        }
    }
}

static inline int k_block_bytes(int type) {
    return type == WEIGHT_Q2_K ? Q2_K_BLOCK_BYTES : type == WEIGHT_Q3_K ? Q3_K_BLOCK_BYTES : type == WEIGHT_Q4_K ? Q4_K_BLOCK_BYTES
           : type == WEIGHT_Q5_K ? Q5_K_BLOCK_BYTES : type == WEIGHT_IQ4_XS ? IQ4_XS_BLOCK_BYTES
           : type == WEIGHT_IQ3_S ? IQ3_S_BLOCK_BYTES : Q6_K_BLOCK_BYTES;
}

/* The lanes of each product's sub-blocks and the constants a run of weight rows shares. */
typedef struct {
    __m512i pick[4]; /* pick[i]: lane L of product i -> its 16-weight sub-block (file comment) */
    __m512i iq4_table;
} KLanes;

static inline __attribute__((always_inline)) KLanes k_lanes(int type) {
    KLanes lanes;
    if (pair_order(type)) { /* product i: groups {0,1,4,5}[i] (lanes 0-7) and that + 2 (lanes 8-15) */
        const __m512i base = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 4, 4, 4, 4, 5, 5, 5, 5);
        for (int i = 0; i < 4; i++) lanes.pick[i] = _mm512_add_epi32(base, _mm512_set1_epi32(2 * ((i & 1) + 4 * (i >> 1))));
    } else if (half_order(type)) { /* product i: half i % 2 of groups 4 (i / 2) .. + 3, four lanes each */
        const __m512i base = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
        for (int i = 0; i < 4; i++) lanes.pick[i] = _mm512_add_epi32(base, _mm512_set1_epi32(8 * (i >> 1) + (i & 1)));
    } else { /* product i: elements 64 i .. 64 i + 63 */
        const __m512i base = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        for (int i = 0; i < 4; i++) lanes.pick[i] = _mm512_add_epi32(base, _mm512_set1_epi32(4 * i));
    }
    lanes.iq4_table = type == WEIGHT_IQ4_XS ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)quant_codebooks.iq4nl)),
                                                               _mm512_set1_epi8((char)0x80))
                                            : _mm512_setzero_si512();
    return lanes;
}

/* A decoded super-block b against row r of x: product i into acc[i % chains], the offsets'
 * term into corr. */
static inline __attribute__((always_inline)) void k_block_row(const KBlock *kb, const KLanes *lanes, const KQuantizedX *qx,
                                                              int64_t k, int64_t b, int r, int chains, __m512 *acc, __m512 *corr) {
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const int64_t at = r * qx->groups + 8 * b;
    *corr = _mm512_fmadd_ps(kb->offset16, _mm512_loadu_ps(qx->xsum16 + 2 * at), *corr);
    const __m512 ds = _mm512_mul_ps(kb->scale16, _mm512_permutexvar_ps(twice, _mm512_maskz_loadu_ps(0xFF, qx->dx + at)));
    const int8_t *xq = qx->q + r * k + 256 * b;
    for (int i = 0; i < 4; i++) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kb->values[i], _mm512_loadu_si512((const void *)(xq + 64 * i)));
        __m512 *chain = acc + (i % chains);
        *chain = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(lanes->pick[i], ds), *chain);
    }
}

/* The sums of two vectors' lanes, together: out[0] of a, out[1] of b. */
static inline void reduce_pair(__m512 a, __m512 b, float *out) {
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
    out[0] = _mm512_cvtss_f32(s);
    out[1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(s, 2));
}

/* Weight rows 0 .. count - 1 (row_bytes apart) against M rows of x: result[j * M + r]. One
 * call per run of weight rows: the lanes' constants are set once a run, and with one row of
 * x the rows' sums are reduced two at a time after it. Per row, at one row of x, the call,
 * its constants and the reduction had cost a fifth of a 2048-wide Q2_K row's time. Each row
 * asks for the row `ahead` rows on into L2 while that is before `limit` (ahead 0: none). */
static inline __attribute__((always_inline)) void k_rows(int type, int M, const KQuantizedX *qx, const uint8_t *rows,
                                                         int64_t row_bytes, int64_t count, int64_t ahead, int64_t limit,
                                                         int64_t k, float *result) {
    const KLanes lanes = k_lanes(type);
    const int block_bytes = k_block_bytes(type);
    /* four chains for one or two rows of x (the multiply-adds' latency would bound a single
     * chain), two for more rows (chains enough, and the registers are short) */
    const int chains = M <= 2 ? 4 : 2;
    __m512 totals[K_RUN]; /* one row of x: the rows' sums, reduced two at a time after the run */
    for (int64_t j = 0; j < count; j++) {
        const uint8_t *row = rows + j * row_bytes;
        if (ahead) stream_prefetch(row, row_bytes, j, ahead, limit);
        __m512 acc[K_ROWS][4], corr[K_ROWS];
        for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = corr[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < k / 256; b++) {
            KBlock kb;
            k_decode(type, row + b * block_bytes, lanes.iq4_table, &kb);
            for (int r = 0; r < M; r++) k_block_row(&kb, &lanes, qx, k, b, r, chains, acc[r], &corr[r]);
        }
        for (int r = 0; r < M; r++) {
            const __m512 total =
                _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])), corr[r]);
            if (M == 1)
                totals[j] = total;
            else
                result[j * M + r] = _mm512_reduce_add_ps(total);
        }
    }
    if (M == 1) {
        for (int64_t j = 0; j + 1 < count; j += 2) reduce_pair(totals[j], totals[j + 1], result + j);
        if (count & 1) result[count - 1] = _mm512_reduce_add_ps(totals[count - 1]);
    }
}

typedef void (*k_fn)(const KQuantizedX *, const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float *);
#define K_FN(TYPE, NAME, M)                                                                                         \
    static __attribute__((noinline)) void NAME##_##M(const KQuantizedX *qx, const uint8_t *rows, int64_t row_bytes, \
                                                     int64_t count, int64_t ahead, int64_t limit, int64_t k,      \
                                                     float *result) {                                             \
        k_rows(TYPE, M, qx, rows, row_bytes, count, ahead, limit, k, result);                                     \
    }
#define K_KERNELS(TYPE, NAME)                                                                               \
    K_FN(TYPE, NAME, 1) K_FN(TYPE, NAME, 2) K_FN(TYPE, NAME, 3) K_FN(TYPE, NAME, 4) K_FN(TYPE, NAME, 5)     \
        K_FN(TYPE, NAME, 6) K_FN(TYPE, NAME, 7) K_FN(TYPE, NAME, 8) static const k_fn NAME[K_ROWS + 1] = { \
            0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8};
K_KERNELS(WEIGHT_Q2_K, q2_k_rows)
K_KERNELS(WEIGHT_Q3_K, q3_k_rows)
K_KERNELS(WEIGHT_Q4_K, q4_k_rows)
K_KERNELS(WEIGHT_Q5_K, q5_k_rows)
K_KERNELS(WEIGHT_Q6_K, q6_k_rows)
K_KERNELS(WEIGHT_IQ4_XS, iq4_xs_rows)
K_KERNELS(WEIGHT_IQ3_S, iq3_s_rows)

int quant_int8_k_supported(int type) {
    return type == WEIGHT_Q2_K || type == WEIGHT_Q3_K || type == WEIGHT_Q4_K || type == WEIGHT_Q5_K || type == WEIGHT_Q6_K ||
           type == WEIGHT_IQ4_XS || type == WEIGHT_IQ3_S;
}

void quant_int8_k_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                              void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    if (begin >= end) return;
    const KQuantizedX qx = quantize_x_k(p->type, x, x_stride, m, k);
    const k_fn *kernels = p->type == WEIGHT_Q2_K ? q2_k_rows : p->type == WEIGHT_Q3_K ? q3_k_rows
                          : p->type == WEIGHT_Q4_K ? q4_k_rows : p->type == WEIGHT_Q5_K ? q5_k_rows
                          : p->type == WEIGHT_IQ4_XS ? iq4_xs_rows : p->type == WEIGHT_IQ3_S ? iq3_s_rows : q6_k_rows;
    const int64_t ahead = stream_prefetch_rows(p->row_bytes);
    float result[K_RUN * K_ROWS];
    for (int64_t n = begin; n < end; n += K_RUN) {
        const int64_t count = end - n < K_RUN ? end - n : K_RUN;
        const uint8_t *rows = p->data + n * p->row_bytes;
        for (int64_t first = 0; first < m; first += K_ROWS) {
            const int tile = m - first < K_ROWS ? (int)(m - first) : K_ROWS;
            KQuantizedX part = qx;
            part.q += first * k;
            part.dx += first * qx.groups;
            part.xsum16 += 2 * first * qx.groups;
            /* the first tile of x asks for the rows ahead; the others find the run in cache */
            kernels[tile](&part, rows, p->row_bytes, count, first == 0 ? ahead : 0, end - n, k, result);
            for (int64_t j = 0; j < count; j++) {
                const float b = bias ? bf16_to_float(bias[n + j]) : 0.0f;
                for (int r = 0; r < tile; r++) store_float(out, (first + r) * out_stride + n + j, result[j * tile + r] + b, out_f32);
            }
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
