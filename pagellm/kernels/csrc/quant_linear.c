/* Kernels, CPU: y = x W^T (+ b) with W in GGUF quantization blocks (Q4_0, Q4_1, Q8_0,
 * Q4_K, Q5_K, Q6_K, MXFP4) or int8 rows, x and y in bf16.
 *
 * Every supported type is, per group of 32 weights along k, small integers u with a
 * scale and an offset: w = scale * u + bias (Q6_K has two scales per group, one per 16).
 * The kernels turn a group's integers into bf16 without arithmetic: for 0 <= u < 128 the
 * bf16 bits 0x4300 | u are exactly 128 + u, so
 *     sum_i x_i w_i = scale * dot(x, 128 + u) + (bias - 128 * scale) * sum_i x_i
 * and the group's dot product is one AVX-512 BF16 instruction. Q8_0 and int8 rows are
 * signed and are converted through float32 instead (exact: |u| <= 128). The sums of x
 * over every 16 columns are computed once per call and reused for all n rows of W.
 *
 * Why bf16 activations rather than int8 ones with integer dot products (llama.cpp's
 * choice): x keeps the precision of the bf16 path, so the quantized layer differs from
 * the dequantized one only by the float32 order of summation, and the decode steps these
 * kernels serve are bound by reading the weights (measured in the README).
 *
 * Up to QUANT_STREAMING_MAX_ROWS rows of x each thread streams its share of W's rows once,
 * unpacking each group in registers (Q4: four groups per 64-byte load, their bytes widened
 * against 0x43 within 128-bit lanes, x permuted once per call to the order that yields). Above that, W is dequantized to bf16 a panel of rows
 * at a time into a per-thread buffer that stays in L2, and small_linear.c (up to
 * STREAMING_MAX_ROWS rows) or gemm_bf16.c's register tiles multiply it.
 *
 * Called through linear.c. Built at run time by pagellm/kernels/build.py; needs AVX-512
 * BF16 like the other bf16 kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"
#include "quant_groups.h"
#include "weights.h"

#define STREAM_ROWS 8 /* rows of x per pass over a weight row */
/* Up to this many rows of x the kernels stream the stored weights (unpacking each group
 * per 8 rows); above, a panel is dequantized to bf16 and multiplied from L2 (measured on
 * SmolLM2's Q4_1 layers, all 30 layers' linears, one thread: 8 rows 16.5 vs 19.4 ms,
 * 16 rows 33.1 vs 25.0 ms). */
#define QUANT_STREAMING_MAX_ROWS 8

int64_t weight_row_bytes(int type, int64_t k) {
    const int index = weight_type_index(type);
    if (index < 0) return -1;
    const WeightTypeTraits *t = &WEIGHT_TYPES[index];
    const int64_t blocks = t->padded_to_even_groups ? padded_groups(k) : k / t->block_values;
    return blocks * t->block_bytes;
}

/* The rest of this file is the AVX-512 BF16 builds' kernels; the others take linear_f32.c's. */
#if defined(__AVX512BF16__)
int quant_type_supported(int type) { return weight_row_bytes(type, 256) > 0 && type != WEIGHT_BF16; }

/* Whether group_words gives 128 + u (unsigned types) rather than the values themselves
 * (int8 rows, the IQ4 codes' signed values, F16). */
static inline int words_shifted(int type) {
    return type != WEIGHT_I8_ROW && type != WEIGHT_F16 && !group_bytes_signed(type);
}

static inline __m512i unsigned_words(__m256i bytes) {
    return _mm512_or_si512(_mm512_cvtepu8_epi16(bytes), _mm512_set1_epi16(0x4300));
}

/* 32 signed bytes as bf16 words (exact: |v| <= 128). */
static inline __m512i signed_words_of(__m256i bytes) {
    __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(fhi, flo);
}

static inline __m512i signed_words(const int8_t *q) { return signed_words_of(_mm256_loadu_si256((const __m256i *)q)); }

/* Group g (32 elements along k) of one weight row as 32 bf16 words, with its scale, for
 * the types read in their own layout (K-quants, int8 rows; the row-packed Q4_0 / Q4_1 /
 * Q8_0 have their own loops below). `type` is a constant where this is inlined, so each
 * kernel keeps one branch. */
static inline __attribute__((always_inline)) __m512i group_words(int type, const uint8_t *row, int64_t g,
                                                                 int64_t k, float row_scale, GroupScale *gs) {
    (void)k;
    if (type == WEIGHT_I8_ROW || type == WEIGHT_F16) {
        gs->scale_lo = gs->scale_hi = type == WEIGHT_F16 ? 1.0f : row_scale;
        gs->min_lo = gs->min_hi = 0.0f;
        if (type == WEIGHT_I8_ROW) return signed_words((const int8_t *)(row + g * 32));
        const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 64 * g)));
        const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 64 * g + 32)));
        return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* rounded to bf16, as the bf16 model holds it */
    }
    if (type == WEIGHT_IQ4_NL || type == WEIGHT_IQ4_XS) { /* each code's value looked up as a bf16 word */
        const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)quant_codebooks.iq4nl)));
        const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
        return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles_in_order(iq4_group(type, row, g, gs))), table);
    }
    const __m256i bytes = group_bytes(type, row, g, gs);
    return group_bytes_signed(type) ? signed_words_of(bytes) : unsigned_words(bytes);
}

/* What sum_i x_i of a half group contributes: w = scale * (128 + u) + min - 128 * scale. */
static inline float bias(int type, float min, float scale) {
    return words_shifted(type) ? min - 128.0f * scale : min;
}

static inline __m512 scale_vector(const GroupScale *gs) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(gs->scale_lo), _mm512_set1_ps(gs->scale_hi));
}

/* Per-thread scratch, grown as needed and kept (OpenMP reuses its threads). */
static _Thread_local float *sums_buffer;
static _Thread_local size_t sums_capacity;
static _Thread_local uint16_t *panel_buffer;
static _Thread_local size_t panel_capacity;

/* sums[r * (k / span) + j] = sum of x[r, span j .. span (j + 1)) in float32, span 16 or 32. */
static void column_sums(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int span, float *sums) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < k / 16; j++) {
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + r * x_stride + 16 * j))), 16));
            const float sum = _mm512_reduce_add_ps(v);
            if (span == 16)
                sums[r * (k / 16) + j] = sum;
            else if (j & 1)
                sums[r * (k / 32) + j / 2] += sum;
            else
                sums[r * (k / 32) + j / 2] = sum;
        }
}

/* One weight row against M (<= STREAM_ROWS) rows of x: out[r] = x[r] . w. Two groups per
 * pass, into two accumulators per row, so that one x row still has two independent chains
 * of fused multiply-adds. */
static inline __attribute__((always_inline)) void stream_row(int type, int M, const uint16_t *x, int64_t x_stride,
                                                             const float *sums, int64_t sums_stride,
                                                             const uint8_t *row, float row_scale, int64_t k,
                                                             float *result) {
    __m512 acc0[STREAM_ROWS], acc1[STREAM_ROWS];
    float corr[STREAM_ROWS];
    for (int r = 0; r < M; r++) {
        acc0[r] = acc1[r] = _mm512_setzero_ps();
        corr[r] = 0.0f;
    }
    const int64_t groups = k / GROUP;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        GroupScale gs0, gs1;
        const __m512bh w0 = (__m512bh)group_words(type, row, g, k, row_scale, &gs0);
        const __m512bh w1 = (__m512bh)group_words(type, row, g + 1, k, row_scale, &gs1);
        const __m512 scale0 = scale_vector(&gs0), scale1 = scale_vector(&gs1);
        for (int r = 0; r < M; r++) {
            const uint16_t *xg = x + r * x_stride + g * GROUP;
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)xg);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(xg + GROUP));
            acc0[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0), scale0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1), scale1, acc1[r]);
            const float *s = sums + r * sums_stride + 2 * g;
            corr[r] += bias(type, gs0.min_lo, gs0.scale_lo) * s[0] + bias(type, gs0.min_hi, gs0.scale_hi) * s[1] +
                       bias(type, gs1.min_lo, gs1.scale_lo) * s[2] + bias(type, gs1.min_hi, gs1.scale_hi) * s[3];
        }
    }
    if (g < groups) {
        GroupScale gs;
        const __m512bh w = (__m512bh)group_words(type, row, g, k, row_scale, &gs);
        const __m512 scale = scale_vector(&gs);
        for (int r = 0; r < M; r++) {
            const __m512bh xr = (__m512bh)_mm512_loadu_si512((const void *)(x + r * x_stride + g * GROUP));
            acc0[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xr, w), scale, acc0[r]);
            const float *s = sums + r * sums_stride + 2 * g;
            corr[r] += bias(type, gs.min_lo, gs.scale_lo) * s[0] + bias(type, gs.min_hi, gs.scale_hi) * s[1];
        }
    }
    for (int r = 0; r < M; r++) result[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) + corr[r];
}

/* The 16 scales and offsets (one per 16 weights) of a super-block of 256, as vectors: the
 * K-quants', Q2_K's, Q3_K's, IQ4_XS's and the grid i-quants' scales decoded once per block
 * instead of per group. */
static inline __attribute__((always_inline)) void superblock_scales(int type, const uint8_t *block, __m512 *scale16,
                                                                    __m512 *min16) {
    if (type == WEIGHT_Q2_K) { /* a byte per 16: scale in the low nibble, min in the high one */
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)block));
        const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
        const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        *scale16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block + 80)), low);
        *min16 = _mm512_mul_ps(_mm512_set1_ps(-half_to_float(block + 82)), high);
        return;
    }
    if (type == WEIGHT_Q6_K) { /* an int8 per 16; u - 32 */
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192))));
        *scale16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block + 208)), sc);
        *min16 = _mm512_mul_ps(_mm512_set1_ps(-32.0f), *scale16);
        return;
    }
    if (type == WEIGHT_Q3_K) { /* u - 4 */
        *scale16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block + 108)),
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q3_k_scales(block + 96))));
        *min16 = _mm512_mul_ps(_mm512_set1_ps(-4.0f), *scale16);
        return;
    }
    if (type == WEIGHT_Q4_K || type == WEIGHT_Q5_K) { /* a 6-bit scale and min per 32: each twice */
        uint64_t scales, mins;
        k_scales_mins(block + 4, &scales, &mins);
        const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(twice, _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scales))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(twice, _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mins))));
        *scale16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block)), sc);
        *min16 = _mm512_mul_ps(_mm512_set1_ps(-half_to_float(block + 2)), mn);
        return;
    }
    float scale[16] __attribute__((aligned(64))), min[16] __attribute__((aligned(64)));
    if (type != WEIGHT_IQ4_XS) { /* the grid i-quants: u = v + 64 */
        for (int ib = 0; ib < 8; ib++) {
            grid_scales(type, block, ib, &scale[2 * ib], &scale[2 * ib + 1]);
            min[2 * ib] = -64.0f * scale[2 * ib];
            min[2 * ib + 1] = -64.0f * scale[2 * ib + 1];
        }
    } else { /* IQ4_XS: a 6-bit scale per 32, minus 32; signed values */
        const float d = half_to_float(block);
        const uint16_t high = load_u16(block + 2);
        for (int j = 0; j < 8; j++) {
            const int low4 = (block[4 + j / 2] >> (4 * (j & 1))) & 0xF;
            scale[2 * j] = scale[2 * j + 1] = d * (float)((low4 | (((high >> (2 * j)) & 3) << 4)) - 32);
            min[2 * j] = min[2 * j + 1] = 0.0f;
        }
    }
    *scale16 = _mm512_load_ps(scale);
    *min16 = _mm512_load_ps(min);
}

/* One row of a 256-weight super-block type against M rows of x, as stream_row with the scales decoded per
 * super-block: each group's words (group_words; its scale arithmetic, unused, is dropped when
 * inlined), one dot product per row, scaled by a permute of the block's scale vector; the
 * offsets' part a 16-lane product with x's sums per 16. */
static inline __attribute__((always_inline)) void stream_superblock_row(int type, int M, const uint16_t *x,
                                                                        int64_t x_stride, const float *sums,
                                                                        int64_t sums_stride, const uint8_t *row,
                                                                        float row_scale, int64_t k, float *result) {
    (void)row_scale;
    const int block_bytes = WEIGHT_TYPES[weight_type_index(type)].block_bytes;
    const int is_signed = !words_shifted(type);
    __m512 acc0[STREAM_ROWS], acc1[STREAM_ROWS], corr[STREAM_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = corr[r] = _mm512_setzero_ps();
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t b = 0; b < k / 256; b++) {
        __m512 scale16, min16;
        superblock_scales(type, row + b * block_bytes, &scale16, &min16);
        if (!is_signed) { /* w = scale (128 + u) + min - 128 scale */
            const __m512 bias16 = _mm512_fnmadd_ps(scale16, _mm512_set1_ps(128.0f), min16);
            for (int r = 0; r < M; r++)
                corr[r] = _mm512_fmadd_ps(bias16, _mm512_loadu_ps(sums + r * sums_stride + 16 * b), corr[r]);
        }
        for (int sub = 0; sub < 8; sub += 2) {
            GroupScale unused0, unused1;
            const __m512bh w0 = (__m512bh)group_words(type, row, 8 * b + sub, k, 1.0f, &unused0);
            const __m512bh w1 = (__m512bh)group_words(type, row, 8 * b + sub + 1, k, 1.0f, &unused1);
            const __m512 s0 = _mm512_permutexvar_ps(_mm512_add_epi32(pick, _mm512_set1_epi32(2 * sub)), scale16);
            const __m512 s1 = _mm512_permutexvar_ps(_mm512_add_epi32(pick, _mm512_set1_epi32(2 * sub + 2)), scale16);
            for (int r = 0; r < M; r++) {
                const uint16_t *xg = x + r * x_stride + (8 * b + sub) * GROUP;
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)xg);
                const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(xg + GROUP));
                acc0[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0), s0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1), s1, acc1[r]);
            }
        }
    }
    for (int r = 0; r < M; r++)
        result[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), corr[r]));
}

/* Four groups a, b, c, d from one 64-byte load of paired nibbles (a and c in `low`, b and d in
 * `high`, values 0..15 a byte each): unpacked against 0x43 into bf16 words 128 + u in the order
 * permute_x_for_q4 put x in, each dot product's lanes 0-7 from one group and 8-15 from the
 * other, scaled by s_ac / s_bd into the accumulators of M rows of x. */
static inline __attribute__((always_inline)) void nibble_pair_groups(int M, const uint16_t *x, int64_t x_stride,
                                                                     int64_t group, __m512i low, __m512i high,
                                                                     __m512 s_ac, __m512 s_bd, __m512 *acc0,
                                                                     __m512 *acc1) {
    const __m512i bf16_high = _mm512_set1_epi8(0x43);
    const __m512bh wa0 = (__m512bh)_mm512_unpacklo_epi8(low, bf16_high);
    const __m512bh wa1 = (__m512bh)_mm512_unpackhi_epi8(low, bf16_high);
    const __m512bh wb0 = (__m512bh)_mm512_unpacklo_epi8(high, bf16_high);
    const __m512bh wb1 = (__m512bh)_mm512_unpackhi_epi8(high, bf16_high);
    for (int r = 0; r < M; r++) {
        const uint16_t *xg = x + r * x_stride + group * GROUP;
        __m512 ac = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512((const void *)xg), wa0);
        ac = _mm512_dpbf16_ps(ac, (__m512bh)_mm512_loadu_si512((const void *)(xg + 32)), wa1);
        __m512 bd = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512((const void *)(xg + 64)), wb0);
        bd = _mm512_dpbf16_ps(bd, (__m512bh)_mm512_loadu_si512((const void *)(xg + 96)), wb1);
        acc0[r] = _mm512_fmadd_ps(ac, s_ac, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(bd, s_bd, acc1[r]);
    }
}

/* A Q4_K row against M rows of x. Its super-blocks' 128 bytes of nibbles pair groups as the
 * row-packed Q4_0 does (32-byte runs, group 2j in the low nibbles, 2j + 1 in the high), so the
 * same 64-byte loads feed four groups through the 0x43 unpacking, against x permuted as for
 * Q4_0 (permute_x_for_q4); each super-block's 8 scales and mins are decoded once
 * (k_scales_mins), the mins' part a vector product with x's sums per 32. */
static inline __attribute__((always_inline)) void stream_q4k_row(int type, int M, const uint16_t *x, int64_t x_stride,
                                                                 const float *sums, int64_t sums_stride,
                                                                 const uint8_t *row, float row_scale, int64_t k,
                                                                 float *result) {
    (void)type, (void)row_scale;
    __m512 acc0[STREAM_ROWS], acc1[STREAM_ROWS], corr[STREAM_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = corr[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i pick_ac = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i pick_bd = _mm512_add_epi32(pick_ac, _mm512_set1_epi32(1));
    for (int64_t b = 0; b < k / 256; b++) {
        const uint8_t *block = row + b * Q4_K_BLOCK_BYTES;
        uint64_t scales, mins;
        k_scales_mins(block + 4, &scales, &mins);
        const __m512 d8 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(block)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scales))));
        const __m512 m8 = _mm512_mul_ps(_mm512_set1_ps(-half_to_float(block + 2)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mins))));
        const __m512 bias8 = _mm512_fnmadd_ps(d8, _mm512_set1_ps(128.0f), m8); /* w = d (128 + u) + m - 128 d */
        for (int r = 0; r < M; r++)
            corr[r] = _mm512_fmadd_ps(bias8, _mm512_maskz_loadu_ps(0xFF, sums + r * sums_stride + 8 * b), corr[r]);
        for (int run = 0; run < 2; run++) {
            const __m512i packed = _mm512_loadu_si512((const void *)(block + 16 + 64 * run));
            const __m512i offset = _mm512_set1_epi32(4 * run);
            nibble_pair_groups(M, x, x_stride, 8 * b + 4 * run, _mm512_and_si512(packed, low4),
                               _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4),
                               _mm512_permutexvar_ps(_mm512_add_epi32(pick_ac, offset), d8),
                               _mm512_permutexvar_ps(_mm512_add_epi32(pick_bd, offset), d8), acc0, acc1);
        }
    }
    for (int r = 0; r < M; r++)
        result[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), corr[r]));
}

/* The same for the row-packed types (Q4_0, Q4_1, Q8_0, MXFP4; layout above padded_groups): the
 * scales of 16 groups convert in one instruction, the Q4 nibbles of two groups come from
 * one 32-byte load, and the offsets' contribution sum_g (min_g - 128 d_g) * sum(x_g) is a
 * vector product over 16 groups at a time (`sums` here: x summed over each 32 columns). */
static inline __attribute__((always_inline)) void stream_packed_row(int type, int M, const uint16_t *x,
                                                                    int64_t x_stride, const float *sums,
                                                                    int64_t sums_stride, const uint8_t *row,
                                                                    float row_scale, int64_t k, float *result) {
    (void)row_scale;
    const int64_t groups = k / GROUP;
    const int is_q8 = type == WEIGHT_Q8_0, is_mx = type == WEIGHT_MXFP4;
    const int64_t stored = is_q8 ? groups : padded_groups(k);
    const uint16_t *d_half = (const uint16_t *)(row + (is_q8 ? k : stored * 16));
    const uint16_t *m_half = d_half + stored;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    /* MXFP4: each nibble looked up as its unsigned code (0..24), w = d u - 12 d. */
    const __m128i codes128 = _mm_load_si128((const __m128i *)MXFP4_UNSIGNED_TABLE);
    const __m256i codes256 = _mm256_broadcastsi128_si256(codes128);
    const __m512i codes512 = _mm512_broadcast_i32x4(codes128);
    __m512 acc0[STREAM_ROWS], acc1[STREAM_ROWS], corr[STREAM_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = corr[r] = _mm512_setzero_ps();
    float d_buf[16] __attribute__((aligned(64)));
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int count = groups - g0 < 16 ? (int)(groups - g0) : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        const __m512 d16 = is_mx ? e8m0_half16((const uint8_t *)d_half + g0, mask)
                                 : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d_half + g0));
        _mm512_store_ps(d_buf, d16);
        if (!is_q8) {
            const __m512 min16 = type == WEIGHT_Q4_1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_half + g0))
                                                     : _mm512_mul_ps(d16, _mm512_set1_ps(is_mx ? -12.0f : -8.0f));
            const __m512 bias16 = _mm512_fnmadd_ps(d16, _mm512_set1_ps(128.0f), min16);
            for (int r = 0; r < M; r++)
                corr[r] = _mm512_fmadd_ps(bias16, _mm512_maskz_loadu_ps(mask, sums + r * sums_stride + g0), corr[r]);
        }
        int g = 0;
        if (!is_q8) {
            /* Four groups per pass from one 64-byte load: low nibbles are groups a and c,
             * high ones b and d; unpacking bytes with 0x43 gives bf16 words in the order
             * permute_x_for_q4 put x in, each dot product's lanes 0-7 from one group and
             * 8-15 from the other. Two groups that share a scale vector share an
             * accumulation before it is scaled. */
            const __m512i low4x = _mm512_set1_epi8(0x0F);
            const __m512i pick_ac = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
            const __m512i pick_bd = _mm512_add_epi32(pick_ac, _mm512_set1_epi32(1));
            const __m512 d_vector = _mm512_load_ps(d_buf);
            for (; g + 4 <= count && g0 + g + 4 <= (groups / 4) * 4; g += 4) {
                const int64_t group = g0 + g;
                const __m512i packed = _mm512_loadu_si512((const void *)(row + 16 * group));
                __m512i low = _mm512_and_si512(packed, low4x);
                __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4x);
                if (is_mx) {
                    low = _mm512_shuffle_epi8(codes512, low);
                    high = _mm512_shuffle_epi8(codes512, high);
                }
                const __m512i offset = _mm512_set1_epi32(g);
                nibble_pair_groups(M, x, x_stride, group, low, high,
                                   _mm512_permutexvar_ps(_mm512_add_epi32(pick_ac, offset), d_vector),
                                   _mm512_permutexvar_ps(_mm512_add_epi32(pick_bd, offset), d_vector), acc0, acc1);
            }
        }
        for (; g + 2 <= count; g += 2) {
            const int64_t group = g0 + g;
            __m512bh w0, w1;
            if (is_q8) {
                w0 = (__m512bh)signed_words((const int8_t *)(row + 32 * group));
                w1 = (__m512bh)signed_words((const int8_t *)(row + 32 * group + 32));
            } else {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(row + 16 * group));
                __m256i u0 = _mm256_and_si256(packed, low4), u1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
                if (is_mx) {
                    u0 = _mm256_shuffle_epi8(codes256, u0);
                    u1 = _mm256_shuffle_epi8(codes256, u1);
                }
                w0 = (__m512bh)unsigned_words(u0);
                w1 = (__m512bh)unsigned_words(u1);
            }
            const __m512 s0 = _mm512_set1_ps(d_buf[g]), s1 = _mm512_set1_ps(d_buf[g + 1]);
            for (int r = 0; r < M; r++) {
                const uint16_t *xg = x + r * x_stride + group * GROUP;
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)xg);
                const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(xg + GROUP));
                acc0[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x0, w0), s0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), x1, w1), s1, acc1[r]);
            }
        }
        if (g < count) { /* the row's last group when their number is odd */
            const int64_t group = g0 + g;
            __m512bh w;
            if (is_q8) {
                w = (__m512bh)signed_words((const int8_t *)(row + 32 * group));
            } else {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(row + 16 * group));
                const __m256i u = _mm256_and_si256(packed, low4);
                w = (__m512bh)unsigned_words(is_mx ? _mm256_shuffle_epi8(codes256, u) : u);
            }
            const __m512 scale = _mm512_set1_ps(d_buf[g]);
            for (int r = 0; r < M; r++) {
                const __m512bh xr = (__m512bh)_mm512_loadu_si512((const void *)(x + r * x_stride + group * GROUP));
                acc0[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xr, w), scale, acc0[r]);
            }
        }
    }
    for (int r = 0; r < M; r++)
        result[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), corr[r]));
}

/* An F16 row: its values widened to float32 (exact) and multiplied into x in float32, so a
 * streamed F16 layer keeps the weights' 11 significant bits (the panel path's bf16 does not). */
static inline __attribute__((always_inline)) void stream_f16_row(int type, int M, const uint16_t *x, int64_t x_stride,
                                                                 const float *sums, int64_t sums_stride,
                                                                 const uint8_t *row, float row_scale, int64_t k,
                                                                 float *result) {
    (void)type, (void)sums, (void)sums_stride, (void)row_scale;
    __m512 acc0[STREAM_ROWS], acc1[STREAM_ROWS];
    for (int r = 0; r < M; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        const __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * i)));
        const __m512 w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * i + 32)));
        for (int r = 0; r < M; r++) {
            const uint16_t *xr = x + r * x_stride + i;
            const __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xr)), 16));
            const __m512 x1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xr + 16))), 16));
            acc0[r] = _mm512_fmadd_ps(x0, w0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(x1, w1, acc1[r]);
        }
    }
    for (int r = 0; r < M; r++) result[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

#define STREAM_FN(NAME, BODY, TYPE, M)                                                                     \
    static __attribute__((noinline)) void NAME##_##M(const uint16_t *x, int64_t x_stride, const float *sums, \
                                                     int64_t sums_stride, const uint8_t *row, float row_scale, \
                                                     int64_t k, float *result) {                           \
        BODY(TYPE, M, x, x_stride, sums, sums_stride, row, row_scale, k, result);                          \
    }
#define STREAM_KERNELS(NAME, BODY, TYPE)                                                                   \
    STREAM_FN(NAME, BODY, TYPE, 1) STREAM_FN(NAME, BODY, TYPE, 2) STREAM_FN(NAME, BODY, TYPE, 3)            \
    STREAM_FN(NAME, BODY, TYPE, 4) STREAM_FN(NAME, BODY, TYPE, 5) STREAM_FN(NAME, BODY, TYPE, 6)            \
    STREAM_FN(NAME, BODY, TYPE, 7) STREAM_FN(NAME, BODY, TYPE, 8)                                           \
    static const stream_fn NAME[STREAM_ROWS + 1] = {0,         NAME##_1, NAME##_2, NAME##_3, NAME##_4,     \
                                                    NAME##_5, NAME##_6, NAME##_7, NAME##_8};
typedef void (*stream_fn)(const uint16_t *, int64_t, const float *, int64_t, const uint8_t *, float, int64_t,
                          float *);

/* At one or two rows of x the super-block types' kernels take a run of up to STREAM_RUN
 * weight rows per call (rows row_bytes apart, result[j * M + r]), so that the constants
 * their bodies set up (scale shuffles, lane masks, tables) are set once a run: a call per
 * row cost a tenth or more of a 2048-wide row's time there (a 1B gate_up layer 9-19% faster
 * at one row for five of seven types, Q4_K and IQ3_S unchanged; 6-29% at two; whole-model
 * single streams 3-14% faster). At 4 and 8 rows runs measured
 * faster for some types and 10-15% slower for others (Q6_K), and for the row-packed types
 * 1.3-2x slower at one row: those keep a call per row. Each row asks for the row
 * `ahead` rows on into L2 while that is before `limit` (ahead 0: none). */
#define STREAM_RUN 16
#define STREAM_RUN_FN(NAME, BODY, TYPE, M)                                                                        \
    static __attribute__((noinline)) void NAME##_##M(const uint16_t *x, int64_t x_stride, const float *sums,    \
                                                     int64_t sums_stride, const uint8_t *rows, int64_t row_bytes, \
                                                     const float *row_scales, int64_t count, int64_t ahead,       \
                                                     int64_t limit, int64_t k, float *result) {                   \
        for (int64_t j = 0; j < count; j++) {                                                                     \
            const uint8_t *row = rows + j * row_bytes;                                                            \
            if (ahead) stream_prefetch(row, row_bytes, j, ahead, limit);                                          \
            BODY(TYPE, M, x, x_stride, sums, sums_stride, row, row_scales ? row_scales[j] : 1.0f, k, result + j * M); \
        }                                                                                                         \
    }
typedef void (*stream_run_fn)(const uint16_t *, int64_t, const float *, int64_t, const uint8_t *, int64_t,
                              const float *, int64_t, int64_t, int64_t, int64_t, float *);
/* NAME: a call per row (any tile of x); NAME##_run: a call per run, for one or two rows. */
#define STREAM_SUPERBLOCK_KERNELS(NAME, BODY, TYPE)                                                            \
    STREAM_KERNELS(NAME, BODY, TYPE)                                                                           \
    STREAM_RUN_FN(NAME##_run, BODY, TYPE, 1) STREAM_RUN_FN(NAME##_run, BODY, TYPE, 2)                         \
    static const stream_run_fn NAME##_run[3] = {0, NAME##_run_1, NAME##_run_2};
STREAM_KERNELS(stream_q4_0, stream_packed_row, WEIGHT_Q4_0)
STREAM_KERNELS(stream_q4_1, stream_packed_row, WEIGHT_Q4_1)
STREAM_KERNELS(stream_q8_0, stream_packed_row, WEIGHT_Q8_0)
STREAM_KERNELS(stream_mxfp4, stream_packed_row, WEIGHT_MXFP4)
STREAM_SUPERBLOCK_KERNELS(stream_q4_k, stream_q4k_row, WEIGHT_Q4_K)
STREAM_SUPERBLOCK_KERNELS(stream_q5_k, stream_superblock_row, WEIGHT_Q5_K)
STREAM_SUPERBLOCK_KERNELS(stream_q6_k, stream_superblock_row, WEIGHT_Q6_K)
STREAM_KERNELS(stream_i8_row, stream_row, WEIGHT_I8_ROW)
STREAM_KERNELS(stream_q5_0, stream_row, WEIGHT_Q5_0)
STREAM_KERNELS(stream_q5_1, stream_row, WEIGHT_Q5_1)
STREAM_SUPERBLOCK_KERNELS(stream_q2_k, stream_superblock_row, WEIGHT_Q2_K)
STREAM_SUPERBLOCK_KERNELS(stream_q3_k, stream_superblock_row, WEIGHT_Q3_K)
STREAM_KERNELS(stream_iq4_nl, stream_row, WEIGHT_IQ4_NL)
STREAM_SUPERBLOCK_KERNELS(stream_iq4_xs, stream_superblock_row, WEIGHT_IQ4_XS)
STREAM_SUPERBLOCK_KERNELS(stream_iq3_xxs, stream_superblock_row, WEIGHT_IQ3_XXS)
STREAM_SUPERBLOCK_KERNELS(stream_iq3_s, stream_superblock_row, WEIGHT_IQ3_S)
STREAM_SUPERBLOCK_KERNELS(stream_iq2_xxs, stream_superblock_row, WEIGHT_IQ2_XXS)
STREAM_SUPERBLOCK_KERNELS(stream_iq2_xs, stream_superblock_row, WEIGHT_IQ2_XS)
STREAM_SUPERBLOCK_KERNELS(stream_iq2_s, stream_superblock_row, WEIGHT_IQ2_S)
STREAM_KERNELS(stream_iq1_s, stream_row, WEIGHT_IQ1_S)
STREAM_KERNELS(stream_iq1_m, stream_row, WEIGHT_IQ1_M)
STREAM_KERNELS(stream_tq1_0, stream_row, WEIGHT_TQ1_0)
STREAM_KERNELS(stream_tq2_0, stream_row, WEIGHT_TQ2_0)
STREAM_KERNELS(stream_f16, stream_f16_row, WEIGHT_F16)

/* Indexed like WEIGHT_TYPES; the types with none here are dequantized to a panel first. The
 * super-block types are in the second table too, for one or two rows of x. */
static const stream_fn *const STREAM_KERNELS_BY_TYPE[WEIGHT_TYPE_COUNT] = {
    [WEIGHT_INDEX_Q4_0] = stream_q4_0, [WEIGHT_INDEX_Q4_1] = stream_q4_1, [WEIGHT_INDEX_Q8_0] = stream_q8_0,
    [WEIGHT_INDEX_Q4_K] = stream_q4_k, [WEIGHT_INDEX_Q5_K] = stream_q5_k, [WEIGHT_INDEX_Q6_K] = stream_q6_k,
    [WEIGHT_INDEX_I8_ROW] = stream_i8_row, [WEIGHT_INDEX_MXFP4] = stream_mxfp4,
    [WEIGHT_INDEX_Q5_0] = stream_q5_0, [WEIGHT_INDEX_Q5_1] = stream_q5_1, [WEIGHT_INDEX_Q2_K] = stream_q2_k,
    [WEIGHT_INDEX_Q3_K] = stream_q3_k, [WEIGHT_INDEX_IQ4_NL] = stream_iq4_nl, [WEIGHT_INDEX_IQ4_XS] = stream_iq4_xs,
    [WEIGHT_INDEX_IQ3_XXS] = stream_iq3_xxs, [WEIGHT_INDEX_IQ3_S] = stream_iq3_s,
    [WEIGHT_INDEX_IQ2_XXS] = stream_iq2_xxs, [WEIGHT_INDEX_IQ2_XS] = stream_iq2_xs, [WEIGHT_INDEX_IQ2_S] = stream_iq2_s,
    [WEIGHT_INDEX_IQ1_S] = stream_iq1_s, [WEIGHT_INDEX_IQ1_M] = stream_iq1_m, [WEIGHT_INDEX_TQ1_0] = stream_tq1_0,
    [WEIGHT_INDEX_TQ2_0] = stream_tq2_0, [WEIGHT_INDEX_F16] = stream_f16,
};
static const stream_run_fn *const STREAM_RUN_KERNELS_BY_TYPE[WEIGHT_TYPE_COUNT] = {
    [WEIGHT_INDEX_Q4_K] = stream_q4_k_run, [WEIGHT_INDEX_Q5_K] = stream_q5_k_run, [WEIGHT_INDEX_Q6_K] = stream_q6_k_run,
    [WEIGHT_INDEX_Q2_K] = stream_q2_k_run, [WEIGHT_INDEX_Q3_K] = stream_q3_k_run, [WEIGHT_INDEX_IQ4_XS] = stream_iq4_xs_run,
    [WEIGHT_INDEX_IQ3_XXS] = stream_iq3_xxs_run, [WEIGHT_INDEX_IQ3_S] = stream_iq3_s_run,
    [WEIGHT_INDEX_IQ2_XXS] = stream_iq2_xxs_run, [WEIGHT_INDEX_IQ2_XS] = stream_iq2_xs_run,
    [WEIGHT_INDEX_IQ2_S] = stream_iq2_s_run,
};

static const stream_fn *stream_kernels(int type) {
    const int index = weight_type_index(type);
    return index >= 0 && STREAM_KERNELS_BY_TYPE[index] ? STREAM_KERNELS_BY_TYPE[index] : stream_i8_row;
}

static const stream_run_fn *stream_run_kernels(int type) {
    const int index = weight_type_index(type);
    return index >= 0 ? STREAM_RUN_KERNELS_BY_TYPE[index] : NULL;
}

/* The order in which the Q4 stream kernel reads x: within each run of 4 groups (128 values),
 * the bf16 words its byte unpacking yields (see stream_packed_row): for groups a, b, c, d of
 * the run, [a0-7 a16-23 c0-7 c16-23], [a8-15 a24-31 c8-15 c24-31], the same for b and d.
 * A shorter tail keeps x's own order. */
static void permute_x_for_q4(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, uint16_t *out) {
    static const uint16_t low_index[32] = {0,  1,  2,  3,  4,  5,  6,  7,  16, 17, 18, 19, 20, 21, 22, 23,
                                           32, 33, 34, 35, 36, 37, 38, 39, 48, 49, 50, 51, 52, 53, 54, 55};
    const __m512i low_halves = _mm512_loadu_si512((const void *)low_index);
    const __m512i high_halves = _mm512_add_epi16(low_halves, _mm512_set1_epi16(8));
    const int64_t runs = k / 128;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *src = x + r * x_stride;
        uint16_t *dst = out + r * k;
        for (int64_t q = 0; q < runs; q++) {
            const __m512i a = _mm512_loadu_si512((const void *)(src + 128 * q));
            const __m512i b = _mm512_loadu_si512((const void *)(src + 128 * q + 32));
            const __m512i c = _mm512_loadu_si512((const void *)(src + 128 * q + 64));
            const __m512i d = _mm512_loadu_si512((const void *)(src + 128 * q + 96));
            _mm512_storeu_si512((void *)(dst + 128 * q), _mm512_permutex2var_epi16(a, low_halves, c));
            _mm512_storeu_si512((void *)(dst + 128 * q + 32), _mm512_permutex2var_epi16(a, high_halves, c));
            _mm512_storeu_si512((void *)(dst + 128 * q + 64), _mm512_permutex2var_epi16(b, low_halves, d));
            _mm512_storeu_si512((void *)(dst + 128 * q + 96), _mm512_permutex2var_epi16(b, high_halves, d));
        }
        memcpy(dst + 128 * runs, src + 128 * runs, sizeof(uint16_t) * (size_t)(k - 128 * runs));
    }
}

static _Thread_local uint16_t *permuted_buffer;
static _Thread_local size_t permuted_capacity;

/* Thread t of nt's share of out[:, rows of this part] for m <= STREAMING_MAX_ROWS. */
static void quant_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                              void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt) {
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    if (begin >= end) return;
    /* Sums of x over 32 columns for the row-packed types, over 16 for the others. */
    const int nibble_pairs = p->type == WEIGHT_Q4_0 || p->type == WEIGHT_Q4_1 || p->type == WEIGHT_MXFP4 ||
                             p->type == WEIGHT_Q4_K;
    const int span = is_row_packed(p->type) || p->type == WEIGHT_Q4_K ? 32 : 16;
    const int64_t sums_stride = k / span;
    float *sums = grow_buffer((void **)&sums_buffer, &sums_capacity, sizeof(float) * (size_t)(m * sums_stride));
    column_sums(x, x_stride, m, k, span, sums);
    if (nibble_pairs) {
        uint16_t *permuted = grow_buffer((void **)&permuted_buffer, &permuted_capacity, sizeof(uint16_t) * (size_t)(m * k));
        permute_x_for_q4(x, x_stride, m, k, permuted);
        x = permuted;
        x_stride = k;
    }
    const int64_t ahead = stream_prefetch_rows(p->row_bytes);
    const stream_run_fn *run_kernels = stream_run_kernels(p->type);
    if (run_kernels && m <= 2) { /* a super-block type at one or two rows of x: runs of rows */
        float results[STREAM_RUN * 2];
        for (int64_t n = begin; n < end; n += STREAM_RUN) {
            const int64_t count = end - n < STREAM_RUN ? end - n : STREAM_RUN;
            run_kernels[m](x, x_stride, sums, sums_stride, p->data + n * p->row_bytes, p->row_bytes,
                           p->row_scales ? p->row_scales + n : NULL, count, ahead, end - n, k, results);
            for (int64_t j = 0; j < count; j++) {
                const float b = bias ? bf16_to_float(bias[n + j]) : 0.0f;
                for (int r = 0; r < m; r++) store_float(out, r * out_stride + n + j, results[j * m + r] + b, out_f32);
            }
        }
        return;
    }
    const stream_fn *kernels = stream_kernels(p->type);
    float result[STREAM_ROWS];
    for (int64_t n = begin; n < end; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        const float row_scale = p->row_scales ? p->row_scales[n] : 1.0f;
        stream_prefetch(row, p->row_bytes, n, ahead, end);
        const float b = bias ? bf16_to_float(bias[n]) : 0.0f;
        for (int64_t first = 0; first < m; first += STREAM_ROWS) {
            const int rows = m - first < STREAM_ROWS ? (int)(m - first) : STREAM_ROWS;
            kernels[rows](x + first * x_stride, x_stride, sums + first * sums_stride, sums_stride, row, row_scale, k,
                   result);
            for (int r = 0; r < rows; r++) store_float(out, (first + r) * out_stride + n, result[r] + b, out_f32);
        }
    }
}

/* Rows [row0, row0 + count) of a part as bf16, row-major [count, k]. */
static inline __attribute__((always_inline)) void dequantize_typed(int type, const WeightPart *p, int64_t row0,
                                                                   int64_t count, int64_t k, uint16_t *out) {
    for (int64_t n = 0; n < count; n++) {
        const uint8_t *row = p->data + (row0 + n) * p->row_bytes;
        const float row_scale = p->row_scales ? p->row_scales[row0 + n] : 1.0f;
        for (int64_t g = 0; g < k / GROUP; g++) {
            GroupScale gs;
            __m512i w = group_words(type, row, g, k, row_scale, &gs);
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
            __m512 hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
            if (words_shifted(type)) { /* exact: 128 + u - 128 */
                lo = _mm512_sub_ps(lo, _mm512_set1_ps(128.0f));
                hi = _mm512_sub_ps(hi, _mm512_set1_ps(128.0f));
            }
            lo = _mm512_fmadd_ps(lo, _mm512_set1_ps(gs.scale_lo), _mm512_set1_ps(gs.min_lo));
            hi = _mm512_fmadd_ps(hi, _mm512_set1_ps(gs.scale_hi), _mm512_set1_ps(gs.min_hi));
            _mm512_storeu_si512((void *)(out + n * k + g * GROUP), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* 32 values (16 at lo, 16 at hi: integers as float32) * d + min, rounded, stored as bf16. */
static inline void store_group(uint16_t *out, __m512 lo, __m512 hi, __m512 d, __m512 min) {
    _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d, min), _mm512_fmadd_ps(lo, d, min)));
}

static inline __m512 bytes_to_float(__m128i bytes, int is_signed) {
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}

/* The row-packed types, 16 groups' scales at a time (the panel path's dequantization is
 * its overhead over the bf16 GEMM, so it gets its own loop). */
static inline __attribute__((always_inline)) void dequantize_packed(int type, const WeightPart *p, int64_t row0,
                                                                    int64_t count, int64_t k, uint16_t *out) {
    const int is_q8 = type == WEIGHT_Q8_0;
    const int vnni = type == WEIGHT_Q4_0_VNNI || type == WEIGHT_Q4_1_VNNI || type == WEIGHT_MXFP4_VNNI;
    const int mx = type == WEIGHT_MXFP4 || type == WEIGHT_MXFP4_VNNI;
    const int64_t groups = k / GROUP, stored = is_q8 ? groups : padded_groups(k), blocked = groups / 16 * 16;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    float d_buf[16] __attribute__((aligned(64))), m_buf[16] __attribute__((aligned(64)));
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 mx_codes = _mm512_load_ps(MXFP4_FLOAT_TABLE);
    for (int64_t n = 0; n < count; n++) {
        const uint8_t *row = p->data + (row0 + n) * p->row_bytes;
        const uint16_t *d_half = (const uint16_t *)(row + (is_q8 ? k : stored * 16));
        uint16_t *dst = out + n * k;
        for (int64_t g0 = 0; g0 < groups; g0 += 16) {
            const int chunk = groups - g0 < 16 ? (int)(groups - g0) : 16;
            const __mmask16 mask = (__mmask16)((1u << chunk) - 1);
            const __m512 d16 = mx ? e8m0_half16((const uint8_t *)d_half + g0, mask)
                                                    : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d_half + g0));
            __m512 min16 = _mm512_setzero_ps();
            if (type == WEIGHT_Q4_1 || type == WEIGHT_Q4_1_VNNI)
                min16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d_half + stored + g0));
            if (type == WEIGHT_Q4_0 || type == WEIGHT_Q4_0_VNNI) min16 = _mm512_mul_ps(d16, _mm512_set1_ps(-8.0f));
            _mm512_store_ps(d_buf, d16);
            _mm512_store_ps(m_buf, min16);
            for (int g = 0; g < chunk; g++) {
                const int64_t group = g0 + g;
                const __m512 d = _mm512_set1_ps(d_buf[g]), min = _mm512_set1_ps(m_buf[g]);
                if (is_q8) {
                    const __m256i values = _mm256_loadu_si256((const __m256i *)(row + 32 * group));
                    store_group(dst + group * GROUP, bytes_to_float(_mm256_castsi256_si128(values), 1),
                                bytes_to_float(_mm256_extracti128_si256(values, 1), 1), d, min);
                } else {
                    /* A 4-bit group has 16 possible values: compute them once (rounded to
                     * bf16 as the float path rounds each weight) and look the 32 up. */
                    __m256i values;
                    if (vnni && group < blocked) { /* quant_int8.c's lane order: 4 bytes per 64 */
                        const uint8_t *at = row + 16 * (group - group % 16) + 4 * (group % 16);
                        int32_t words[4];
                        for (int L = 0; L < 4; L++) memcpy(&words[L], at + 64 * L, 4);
                        const __m128i bytes = _mm_loadu_si128((const __m128i *)words);
                        const __m128i lo = _mm_and_si128(bytes, _mm256_castsi256_si128(low4));
                        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm256_castsi256_si128(low4));
                        values = _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
                    } else {
                        const __m256i packed = _mm256_loadu_si256((const __m256i *)(row + 16 * (group & ~(int64_t)1)));
                        values = _mm256_and_si256((group & 1) ? _mm256_srli_epi16(packed, 4) : packed, low4);
                    }
                    /* MXFP4's codes are the doubled E2M1 values (d halved for them), no offset */
                    const __m512 values16 = mx ? _mm512_mul_ps(mx_codes, d) : _mm512_fmadd_ps(iota, d, min);
                    const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values16));
                    _mm512_storeu_si512((void *)(dst + group * GROUP),
                                        _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(values), table));
                }
            }
        }
    }
}

static void dequantize_part_rows(const WeightPart *p, int64_t row0, int64_t count, int64_t k, uint16_t *out) {
    switch (p->type) {
    case WEIGHT_Q4_0: dequantize_packed(WEIGHT_Q4_0, p, row0, count, k, out); break;
    case WEIGHT_Q4_1: dequantize_packed(WEIGHT_Q4_1, p, row0, count, k, out); break;
    case WEIGHT_Q4_0_VNNI: dequantize_packed(WEIGHT_Q4_0_VNNI, p, row0, count, k, out); break;
    case WEIGHT_Q4_1_VNNI: dequantize_packed(WEIGHT_Q4_1_VNNI, p, row0, count, k, out); break;
    case WEIGHT_MXFP4_VNNI: dequantize_packed(WEIGHT_MXFP4_VNNI, p, row0, count, k, out); break;
    case WEIGHT_Q8_0: dequantize_packed(WEIGHT_Q8_0, p, row0, count, k, out); break;
    case WEIGHT_MXFP4: dequantize_packed(WEIGHT_MXFP4, p, row0, count, k, out); break;
    case WEIGHT_Q4_K: dequantize_typed(WEIGHT_Q4_K, p, row0, count, k, out); break;
    case WEIGHT_Q5_K: dequantize_typed(WEIGHT_Q5_K, p, row0, count, k, out); break;
    case WEIGHT_Q6_K: dequantize_typed(WEIGHT_Q6_K, p, row0, count, k, out); break;
    case WEIGHT_I8_ROW: dequantize_typed(WEIGHT_I8_ROW, p, row0, count, k, out); break;
    case WEIGHT_Q5_0: dequantize_typed(WEIGHT_Q5_0, p, row0, count, k, out); break;
    case WEIGHT_Q5_1: dequantize_typed(WEIGHT_Q5_1, p, row0, count, k, out); break;
    case WEIGHT_Q2_K: dequantize_typed(WEIGHT_Q2_K, p, row0, count, k, out); break;
    case WEIGHT_Q3_K: dequantize_typed(WEIGHT_Q3_K, p, row0, count, k, out); break;
    case WEIGHT_IQ4_NL: dequantize_typed(WEIGHT_IQ4_NL, p, row0, count, k, out); break;
    case WEIGHT_IQ4_XS: dequantize_typed(WEIGHT_IQ4_XS, p, row0, count, k, out); break;
    case WEIGHT_IQ3_XXS: dequantize_typed(WEIGHT_IQ3_XXS, p, row0, count, k, out); break;
    case WEIGHT_IQ3_S: dequantize_typed(WEIGHT_IQ3_S, p, row0, count, k, out); break;
    case WEIGHT_IQ2_XXS: dequantize_typed(WEIGHT_IQ2_XXS, p, row0, count, k, out); break;
    case WEIGHT_IQ2_XS: dequantize_typed(WEIGHT_IQ2_XS, p, row0, count, k, out); break;
    case WEIGHT_IQ2_S: dequantize_typed(WEIGHT_IQ2_S, p, row0, count, k, out); break;
    case WEIGHT_IQ1_S: dequantize_typed(WEIGHT_IQ1_S, p, row0, count, k, out); break;
    case WEIGHT_IQ1_M: dequantize_typed(WEIGHT_IQ1_M, p, row0, count, k, out); break;
    case WEIGHT_TQ1_0: dequantize_typed(WEIGHT_TQ1_0, p, row0, count, k, out); break;
    case WEIGHT_TQ2_0: dequantize_typed(WEIGHT_TQ2_0, p, row0, count, k, out); break;
    case WEIGHT_F16: dequantize_typed(WEIGHT_F16, p, row0, count, k, out); break;
    case WEIGHT_BF16: memcpy(out, p->data + row0 * p->row_bytes, (size_t)(count * k * 2)); break;
    default: break;
    }
}

/* Thread t of nt's share for m > STREAMING_MAX_ROWS: a panel of W's rows at a time is
 * dequantized into this thread's buffer (kept within L2) and multiplied by the bf16 GEMM. */
static void quant_gemm_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                            void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int impl, int t,
                            int nt) {
    int64_t begin, end;
    thread_share(p->rows, 16, t, nt, &begin, &end);
    const int64_t panel = k <= 2048 ? 64 : (k <= 4096 ? 32 : 16);
    uint16_t *buffer = grow_buffer((void **)&panel_buffer, &panel_capacity, sizeof(uint16_t) * (size_t)(panel * k));
    for (int64_t n = begin; n < end; n += panel) {
        const int64_t count = end - n < panel ? end - n : panel;
        dequantize_part_rows(p, n, count, k, buffer);
        /* The next panel's stored rows (contiguous) are read into L2 while this panel is
         * multiplied, so that dequantizing them does not wait on memory (measured: the
         * dequantization of a 1B-sized layer's weights took 1.55 ms from memory, 0.81 ms
         * from cache). */
        const int64_t next = n + count, next_count = end - next < panel ? end - next : panel;
        if (next_count > 0) {
            const char *from = (const char *)(p->data + next * p->row_bytes);
            for (int64_t offset = 0; offset < next_count * p->row_bytes; offset += 64)
                _mm_prefetch(from + offset, _MM_HINT_T1);
        }
        void *panel_out = out_at(out, n, out_f32);
        const uint16_t *panel_bias = bias ? bias + n : NULL;
        if (impl == LINEAR_AMX && gemm_amx_part(x, x_stride, buffer, panel_bias, panel_out, out_stride, out_f32, m,
                                                count, k, 0, 1))
            continue;
        if (m <= STREAMING_MAX_ROWS) /* few rows: the panel streams from L2 */
            small_linear_bf16_part(x, x_stride, buffer, bias ? bias + n : NULL, panel_out, out_stride, out_f32, m,
                                   count, k, 0, 1);
        else
            gemm_bf16_part(x, x_stride, buffer, bias ? bias + n : NULL, panel_out, out_stride, out_f32, m, count, k,
                           0, 1);
    }
}
/* Thread t of nt's share of out = x W^T (+ bias) for any Weight, inside a parallel region;
 * impl (kernels.h LINEAR_*) names the streaming or the panel/GEMM kernels, or leaves them
 * to the row count. */
void linear_weight_part(const uint16_t *x, int64_t x_stride, const Weight *w, const uint16_t *bias, void *out,
                        int64_t out_stride, int out_f32, int64_t m, int64_t k, int impl, int t, int nt) {
    int64_t offset = 0;
    for (int i = 0; i < w->num_parts; i++) {
        const WeightPart *p = &w->parts[i];
        const uint16_t *part_bias = bias ? bias + offset : NULL;
        void *part_out = out_at(out, offset, out_f32);
        const int stream = impl_streams(impl) || (impl == LINEAR_BY_ROWS && m <= QUANT_STREAMING_MAX_ROWS);
        if (p->type == WEIGHT_BF16)
            linear_bf16_part(x, x_stride, (const uint16_t *)p->data, part_bias, part_out, out_stride, out_f32, m,
                             p->rows, k, impl, t, nt);
        else if (quant_int8_supported(p->type) &&
                 (impl == LINEAR_STREAMING_INT8 || (stream && (p->type == WEIGHT_Q4_0_VNNI || p->type == WEIGHT_Q4_1_VNNI ||
                                                                  p->type == WEIGHT_MXFP4_VNNI))))
            /* a VNNI part's only streaming kernel; other parts stream in bf16 below */
            quant_int8_stream_part(x, x_stride, p, part_bias, part_out, out_stride, out_f32, m, k, t, nt);
        else if (stream)
            quant_stream_part(x, x_stride, p, part_bias, part_out, out_stride, out_f32, m, k, t, nt);
        else
            quant_gemm_part(x, x_stride, p, part_bias, part_out, out_stride, out_f32, m, k, impl, t, nt);
        offset += p->rows;
    }
}

/* Rows [row0, row0 + count) of one part as bf16 [count, k] (the embedding lookup, tests,
 * and the PyTorch fallback). */
void dequantize_rows_bf16(const WeightPart *p, int64_t row0, int64_t count, int64_t k, uint16_t *out) {
    dequantize_part_rows(p, row0, count, k, out);
}

/* Gathered rows ids[0 .. count) of one part as bf16 [count, k] (embedding lookup). */
void gather_rows_bf16(const WeightPart *p, const int64_t *ids, int64_t count, int64_t k, uint16_t *out) {
    for (int64_t i = 0; i < count; i++) dequantize_part_rows(p, ids[i], 1, k, out + i * k);
}
#endif
