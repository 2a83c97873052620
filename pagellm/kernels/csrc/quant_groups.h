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

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline int64_t padded_groups(int64_t k) { return (k / 32 + 1) / 2 * 2; }

#if defined(__AVX512BW__)
/* 32 bf16 values of x rounded to int8 as llama.cpp's Q8 activations (the int8-activation
 * kernels): q = round(x / dx) with dx = max |x| / 127 (0 for a group of zeros), values 0-15
 * in *low and 16-31 in *high as int32 lanes; returns dx. */
static inline float round_group_to_int8(const uint16_t *x, __m512i *low, __m512i *high) {
    const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16))), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *low = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
    *high = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
    return amax / 127.0f;
}

/* 16 E8M0 exponent bytes (the first `mask` ones) as their d = 2^(E - 128) (e8m0_half below). */
static inline __m512 e8m0_half16(const uint8_t *e, __mmask16 mask) {
    const __m512i exponent = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, e));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(exponent, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), exponent);
    const __mmask16 is_tiny = _mm512_cmplt_epi32_mask(exponent, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_tiny, normal, tiny));
}
#endif

/* The streaming kernels read each weight row once, and ask for the row about
 * STREAM_PREFETCH_BYTES ahead (at least two rows), whole, into L2. Into L1 (T0), long rows
 * (a 1B model's down projection, 3168-byte Q4_K rows, four ahead) pushed x and the current
 * row out of L1: 11-14 GB/s at one row of x where the same bytes in 1152-byte rows
 * streamed at 20-25 (2 threads, AMD EPYC Zen 4); into L2 both shapes stream at 21-25. */
#define STREAM_PREFETCH_BYTES 8192

static inline int64_t stream_prefetch_rows(int64_t row_bytes) {
    const int64_t rows = STREAM_PREFETCH_BYTES / (row_bytes > 0 ? row_bytes : 1);
    return rows < 2 ? 2 : rows;
}

/* Row n + ahead of a part's rows [.., end), whole, into L2 (nothing past the end). */
static inline void stream_prefetch(const uint8_t *row, int64_t row_bytes, int64_t n, int64_t ahead, int64_t end) {
    if (n + ahead >= end) return;
    const char *from = (const char *)(row + ahead * row_bytes);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) _mm_prefetch(from + offset, _MM_HINT_T1);
}

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

/* All 8 scales and mins of a Q4_K / Q5_K super-block at once, a byte each (k_scale_min's
 * packing read as three words a, b, c, each byte a lane: scales 0-3 are a's low 6 bits, mins
 * 0-3 b's; scales 4-7 are c's low nibbles with a's top 2 bits above them, mins 4-7 c's high
 * nibbles with b's). */
static inline void k_scales_mins(const uint8_t *packed, uint64_t *scales, uint64_t *mins) {
    const uint32_t a = load_u32(packed), b = load_u32(packed + 4), c = load_u32(packed + 8);
    *scales = (uint64_t)(a & 0x3F3F3F3Fu) | (uint64_t)((c & 0x0F0F0F0Fu) | (((a >> 6) & 0x03030303u) << 4)) << 32;
    *mins = (uint64_t)(b & 0x3F3F3F3Fu) | (uint64_t)(((c >> 4) & 0x0F0F0F0Fu) | (((b >> 6) & 0x03030303u) << 4)) << 32;
}

/* Q3_K's 16 signed 6-bit scales (12 bytes: low nibbles of bytes 0-7 for scales 0-7, their
 * high nibbles for 8-15; bits 2a, 2a + 1 of byte 8 + b the top bits of scale 4a + b), minus 32. */
static inline __m128i q3_k_scales(const uint8_t *packed) {
    const __m128i low = _mm_loadl_epi64((const __m128i *)packed), nibble = _mm_set1_epi8(0x0F);
    const __m128i low4 = _mm_unpacklo_epi64(_mm_and_si128(low, nibble), _mm_and_si128(_mm_srli_epi16(low, 4), nibble));
    const __m128i high = _mm_srlv_epi32(_mm_set1_epi32((int)load_u32(packed + 8)), _mm_setr_epi32(0, 2, 4, 6));
    const __m128i high2 = _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(3)), 4);
    return _mm_sub_epi8(_mm_or_si128(low4, high2), _mm_set1_epi8(32));
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

/* The other GGUF types, read in the file's own layout, 32 weights at a time as unsigned
 * integers u <= 127 with a scale and an offset per 16 (so the kernels' arithmetic on u is
 * the K-quants'), except IQ4_NL / IQ4_XS, whose 4-bit codes index a table of signed
 * values (-127..113), and the ternary TQ types: those come out as their signed values
 * (group_bytes_signed). Each type's
 * integers, from its definition (the `gguf` package's reference dequantization is the
 * test's reference):
 *   Q5_0 / Q5_1  (32)  a nibble plus a fifth bit from the block's 32-bit qh: u 0..31,
 *                      w = d (u - 16), or d u + m;
 *   Q2_K  (256)   2-bit u, each 16 with a 4-bit scale and a 4-bit min: w = d sc u - dmin m;
 *   Q3_K  (256)   2 bits plus a high bit (set means no offset): u 0..7, w = d (sc - 32) (u - 4);
 *   TQ2_0 / TQ1_0 (256)  ternary digits (2 bits, or base 3 packed 5 to a byte) t: w = d (t - 1);
 *   IQ2_XXS / IQ2_XS / IQ2_S, IQ3_XXS / IQ3_S (256)  runs of 8 (IQ3: 4) magnitudes from a
 *                      codebook indexed by 8-10 bits, with sign bits (XXS / XS: 7 stored, the
 *                      eighth making their count even): v = sign * grid value, u = v + 64;
 *   IQ1_S / IQ1_M (256)  runs of 8 values in {-1, 0, 1} from an 11-bit codebook index, plus
 *                      a shift of +-1/8 per 32 (IQ1_M: per 8): v = 8 grid +- 1, u = v + 16,
 *                      the scale divided by 8.
 * The codebooks are kernels/codebooks.py's, set once per library (quant_set_codebooks). */
typedef struct {
    const uint64_t *iq2xxs, *iq2xs, *iq2s; /* 8 magnitudes a byte each: [256], [512], [1024] */
    const uint32_t *iq3xxs, *iq3s;         /* 4 magnitudes a byte each: [256], [512] */
    const uint64_t *iq1s;                  /* 8 int8 in {-1, 0, 1}: [2048] */
    const int8_t *iq4nl;                   /* [16] */
} Codebooks;
extern Codebooks quant_codebooks;
extern uint16_t quant_iq3s_words[512]; /* IQ3_S's entries as 4-bit magnitudes (codebooks.c) */

#define Q2_K_BLOCK_BYTES 84
#define Q3_K_BLOCK_BYTES 110
#define IQ4_XS_BLOCK_BYTES 136
#define IQ3_XXS_BLOCK_BYTES 98
#define IQ3_S_BLOCK_BYTES 110
#define IQ2_XXS_BLOCK_BYTES 66
#define IQ2_XS_BLOCK_BYTES 74
#define IQ2_S_BLOCK_BYTES 82
#define IQ1_S_BLOCK_BYTES 50
#define IQ1_M_BLOCK_BYTES 56
#define TQ1_0_BLOCK_BYTES 54
#define TQ2_0_BLOCK_BYTES 66

/* The types whose groups come out as signed values rather than u: IQ4's (beyond 7 bits) and
 * the ternary ones (-1, 0, 1: as 128 + u, their dot products would be mostly offset). */
static inline int group_bytes_signed(int type) {
    return type == WEIGHT_IQ4_NL || type == WEIGHT_IQ4_XS || type == WEIGHT_TQ1_0 || type == WEIGHT_TQ2_0;
}

/* Byte i of the result is `value` where bit i of `bits` is set, else 0. */
static inline __m256i bits32_to_bytes(uint32_t bits, char value) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                                                2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(value));
}

/* 16 bytes of nibbles as 32 bytes: the low nibbles (elements 0-15), then the high ones. */
static inline __m256i nibbles_in_order(const uint8_t *qs) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
}

/* The eighth sign of IQ2_XXS / IQ2_XS / IQ3_XXS's 7 stored ones: their count is even. */
static inline unsigned even_signs(unsigned seven) { return seven | ((unsigned)__builtin_parity(seven) << 7); }

/* u = offset + m where sign bit i (of 32) is clear, offset - m where it is set, per byte. */
static inline __m256i signed_offset(__m256i magnitudes, uint32_t signs, char offset) {
    const __m256i base = _mm256_set1_epi8(offset);
    return _mm256_blendv_epi8(_mm256_add_epi8(base, magnitudes), _mm256_sub_epi8(base, magnitudes),
                              bits32_to_bytes(signs, (char)0xFF));
}

/* 4 runs' 7 stored sign bits (at bits 0, 7, 14, 21 of `packed`) as their 32 signs. */
static inline uint32_t four_even_signs(uint32_t packed) {
    uint32_t signs = 0;
    for (int l = 0; l < 4; l++) signs |= even_signs((packed >> (7 * l)) & 127) << (8 * l);
    return signs;
}

/* The scales of sub-block ib (32 weights; lo and hi 16 each) of a grid i-quant's super-block. */
static inline void grid_scales(int type, const uint8_t *block, int64_t ib, float *lo, float *hi) {
    const float d = half_to_float(block);
    switch (type) {
    case WEIGHT_IQ3_S: *lo = *hi = d * (float)(1 + 2 * ((block[106 + ib / 2] >> (4 * (ib & 1))) & 0xF)); return;
    case WEIGHT_IQ3_XXS: *lo = *hi = d * (0.5f + (float)(load_u32(block + 66 + 4 * ib) >> 28)) * 0.5f; return;
    case WEIGHT_IQ2_XXS: *lo = *hi = d * (0.5f + (float)(load_u32(block + 6 + 8 * ib) >> 28)) * 0.25f; return;
    default: { /* IQ2_XS, IQ2_S: a 4-bit scale per 16 */
        const uint8_t scales = block[(type == WEIGHT_IQ2_XS ? 66 : 74) + ib];
        *lo = d * (0.5f + (float)(scales & 0xF)) * 0.25f;
        *hi = d * (0.5f + (float)(scales >> 4)) * 0.25f;
    }
    }
}

/* Groups of the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): the 4 (IQ3: 8)
 * entries' magnitudes gathered from their codebook, signs applied around an offset of 64. */
static inline __attribute__((always_inline)) __m256i grid_group(int type, const uint8_t *row, int64_t g,
                                                                GroupScale *gs) {
    const int64_t ib = g & 7;
    const Codebooks *cb = &quant_codebooks;
    __m256i magnitudes;
    uint32_t signs;
    if (type == WEIGHT_IQ3_XXS || type == WEIGHT_IQ3_S) {
        const int is_s = type == WEIGHT_IQ3_S;
        const uint8_t *block = row + (g >> 3) * (is_s ? IQ3_S_BLOCK_BYTES : IQ3_XXS_BLOCK_BYTES);
        __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 2 + 8 * ib)));
        if (is_s) { /* the ninth bit of entry i: bit i of qh[ib] */
            const __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(block[66 + ib]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            index = _mm256_or_si256(index, _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), 8));
            signs = load_u32(block + 74 + 4 * ib);
        } else {
            signs = four_even_signs(load_u32(block + 66 + 4 * ib));
        }
        grid_scales(type, block, ib, &gs->scale_lo, &gs->scale_hi);
        magnitudes = _mm256_i32gather_epi32((const int *)(is_s ? cb->iq3s : cb->iq3xxs), index, 4);
    } else {
        int32_t index[4];
        const uint8_t *block;
        if (type == WEIGHT_IQ2_XXS) {
            block = row + (g >> 3) * IQ2_XXS_BLOCK_BYTES;
            const uint8_t *q = block + 2 + 8 * ib;
            for (int l = 0; l < 4; l++) index[l] = q[l];
            signs = four_even_signs(load_u32(q + 4));
        } else {
            if (type == WEIGHT_IQ2_XS) { /* 16-bit entries: a 9-bit index, 7 sign bits */
                block = row + (g >> 3) * IQ2_XS_BLOCK_BYTES;
                uint32_t packed = 0;
                for (int l = 0; l < 4; l++) {
                    const uint16_t entry = load_u16(block + 2 + 8 * ib + 2 * l);
                    index[l] = entry & 511;
                    packed |= (uint32_t)(entry >> 9) << (7 * l);
                }
                signs = four_even_signs(packed);
            } else { /* IQ2_S: an index byte plus 2 high bits, explicit sign bytes */
                block = row + (g >> 3) * IQ2_S_BLOCK_BYTES;
                const uint8_t high = block[66 + ib];
                for (int l = 0; l < 4; l++) index[l] = block[2 + 4 * ib + l] | (((high >> (2 * l)) & 3) << 8);
                signs = load_u32(block + 34 + 4 * ib);
            }
        }
        grid_scales(type, block, ib, &gs->scale_lo, &gs->scale_hi);
        const uint64_t *grid = type == WEIGHT_IQ2_XXS ? cb->iq2xxs : (type == WEIGHT_IQ2_XS ? cb->iq2xs : cb->iq2s);
        magnitudes = _mm256_i32gather_epi64((const long long *)grid, _mm_loadu_si128((const __m128i *)index), 8);
    }
    gs->min_lo = -64.0f * gs->scale_lo;
    gs->min_hi = -64.0f * gs->scale_hi;
    return signed_offset(magnitudes, signs, 64);
}

/* Groups of IQ1_S, IQ1_M and TQ1_0, decoded in scalar code into u[32]. */
static inline void codebook_group(int type, const uint8_t *row, int64_t g, uint8_t *u, GroupScale *gs) {
    const int64_t ib = g & 7;
    const Codebooks *cb = &quant_codebooks;
    switch (type) {
    case WEIGHT_IQ1_S: {
        const uint8_t *block = row + (g >> 3) * IQ1_S_BLOCK_BYTES;
        const uint16_t high = load_u16(block + 34 + 2 * ib);
        const int shift = (high & 0x8000) ? -1 : 1; /* the delta, 1/8, times 8 */
        gs->scale_lo = gs->scale_hi = half_to_float(block) * (float)(2 * ((high >> 12) & 7) + 1) * 0.125f;
        for (int l = 0; l < 4; l++) {
            const uint64_t values = cb->iq1s[block[2 + 4 * ib + l] | (((high >> (3 * l)) & 7) << 8)];
            for (int j = 0; j < 8; j++) u[8 * l + j] = (uint8_t)(16 + 8 * (int8_t)(values >> (8 * j)) + shift);
        }
        gs->min_lo = gs->min_hi = -16.0f * gs->scale_lo;
        return;
    }
    case WEIGHT_IQ1_M: {
        const uint8_t *block = row + (g >> 3) * IQ1_M_BLOCK_BYTES;
        uint16_t sc[4];
        memcpy(sc, block + 48, 8);
        const uint16_t d_bits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000));
        const float d = _cvtsh_ss(d_bits);
        const int shift = 6 * (int)(ib & 1);
        gs->scale_lo = d * (float)(2 * ((sc[ib / 2] >> shift) & 7) + 1) * 0.125f;
        gs->scale_hi = d * (float)(2 * ((sc[ib / 2] >> (shift + 3)) & 7) + 1) * 0.125f;
        for (int l = 0; l < 4; l++) {
            const int nibble = (block[32 + 2 * ib + l / 2] >> (4 * (l & 1))) & 0xF;
            const uint64_t values = cb->iq1s[block[4 * ib + l] | ((nibble & 7) << 8)];
            const int delta = (nibble & 8) ? -1 : 1;
            for (int j = 0; j < 8; j++) u[8 * l + j] = (uint8_t)(16 + 8 * (int8_t)(values >> (8 * j)) + delta);
        }
        gs->min_lo = -16.0f * gs->scale_lo;
        gs->min_hi = -16.0f * gs->scale_hi;
        return;
    }
    case WEIGHT_TQ1_0: { /* digit of a byte q at place p: ((uint8)(q * 3^p) * 3) >> 8 */
        static const uint8_t powers[5] = {1, 3, 9, 27, 81};
        const uint8_t *block = row + (g >> 3) * TQ1_0_BLOCK_BYTES;
        gs->scale_lo = gs->scale_hi = half_to_float(block + 52);
        gs->min_lo = gs->min_hi = 0.0f;
        for (int i = 0; i < 32; i++) {
            int byte, place;
            if (ib < 5) { /* elements 32 p + i of the first 32 bytes */
                byte = block[i];
                place = (int)ib;
            } else { /* then 16 p + i of the next 16, then 4 p + i of the last 4 */
                const int e = 32 * (int)ib + i - 160;
                if (e < 80) {
                    byte = block[32 + e % 16];
                    place = e / 16;
                } else {
                    byte = block[48 + (e - 80) % 4];
                    place = (e - 80) / 4;
                }
            }
            u[i] = (uint8_t)((((uint8_t)(byte * powers[place]) * 3) >> 8) - 1); /* the signed digit */
        }
        return;
    }
    default: break;
    }
}

/* An IQ4_NL / IQ4_XS group's 16 bytes of 4-bit codes, and its scale (the values are signed). */
static inline const uint8_t *iq4_group(int type, const uint8_t *row, int64_t g, GroupScale *gs) {
    gs->min_lo = gs->min_hi = 0.0f;
    if (type == WEIGHT_IQ4_NL) {
        const uint8_t *block = row + g * 18;
        gs->scale_lo = gs->scale_hi = half_to_float(block);
        return block + 2;
    }
    const int64_t sub = g & 7;
    const uint8_t *block = row + (g >> 3) * IQ4_XS_BLOCK_BYTES;
    const int low4 = (block[4 + sub / 2] >> (4 * (sub & 1))) & 0xF;
    const int high2 = (load_u16(block + 2) >> (2 * sub)) & 3;
    gs->scale_lo = gs->scale_hi = half_to_float(block) * (float)((low4 | (high2 << 4)) - 32);
    return block + 8 + 16 * sub;
}

/* Group g of any type read in the file's own layout (the K-quants and the types above):
 * 32 bytes, unsigned u (signed values for group_bytes_signed types), and the scales. */
static inline __attribute__((always_inline)) __m256i group_bytes(int type, const uint8_t *row, int64_t g,
                                                                 GroupScale *gs) {
    const int64_t sub = g & 7;
    switch (type) {
    case WEIGHT_Q4_K:
    case WEIGHT_Q5_K:
    case WEIGHT_Q6_K: return k_group_bytes(type, row, g, gs);
    case WEIGHT_Q5_0:
    case WEIGHT_Q5_1: {
        const uint8_t *block = row + g * (type == WEIGHT_Q5_0 ? 22 : 24);
        const uint8_t *qh = block + (type == WEIGHT_Q5_0 ? 2 : 4);
        const float d = half_to_float(block);
        gs->scale_lo = gs->scale_hi = d;
        gs->min_lo = gs->min_hi = type == WEIGHT_Q5_0 ? -16.0f * d : half_to_float(block + 2);
        return _mm256_or_si256(nibbles_in_order(qh + 4), bits32_to_bytes(load_u32(qh), 0x10));
    }
    case WEIGHT_Q2_K:
    case WEIGHT_TQ2_0: { /* group 4 h + s: bits 2 s of the 32 bytes at 32 h */
        const int is_q2 = type == WEIGHT_Q2_K;
        const uint8_t *block = row + (g >> 3) * (is_q2 ? Q2_K_BLOCK_BYTES : TQ2_0_BLOCK_BYTES);
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + (is_q2 ? 16 : 0) + 32 * (sub >> 2)));
        const __m256i u = _mm256_and_si256(_mm256_srl_epi16(packed, _mm_cvtsi64_si128(2 * (sub & 3))), _mm256_set1_epi8(3));
        if (is_q2) {
            const float d = half_to_float(block + 80), dmin = half_to_float(block + 82);
            const uint8_t lo = block[2 * sub], hi = block[2 * sub + 1];
            gs->scale_lo = d * (float)(lo & 0xF);
            gs->scale_hi = d * (float)(hi & 0xF);
            gs->min_lo = -dmin * (float)(lo >> 4);
            gs->min_hi = -dmin * (float)(hi >> 4);
            return u;
        }
        gs->scale_lo = gs->scale_hi = half_to_float(block + 64);
        gs->min_lo = gs->min_hi = 0.0f;
        return _mm256_sub_epi8(u, _mm256_set1_epi8(1)); /* signed t - 1 (3, which no quantizer writes, reads as 2) */
    }
    case WEIGHT_Q3_K: {
        const uint8_t *block = row + (g >> 3) * Q3_K_BLOCK_BYTES, *scales = block + 96;
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * (sub >> 2)));
        const __m256i low = _mm256_and_si256(_mm256_srl_epi16(packed, _mm_cvtsi64_si128(2 * (sub & 3))), _mm256_set1_epi8(3));
        const __m256i mask = _mm256_loadu_si256((const __m256i *)block);
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(mask, _mm_cvtsi64_si128(sub)), _mm256_set1_epi8(1));
        const float d = half_to_float(block + 108);
        int8_t scale[16];
        _mm_storeu_si128((__m128i *)scale, q3_k_scales(scales));
        gs->scale_lo = d * (float)scale[2 * sub];
        gs->scale_hi = d * (float)scale[2 * sub + 1];
        gs->min_lo = -4.0f * gs->scale_lo;
        gs->min_hi = -4.0f * gs->scale_hi;
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
    }
    case WEIGHT_IQ4_NL:
    case WEIGHT_IQ4_XS: {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quant_codebooks.iq4nl));
        return _mm256_shuffle_epi8(table, nibbles_in_order(iq4_group(type, row, g, gs)));
    }
    case WEIGHT_IQ2_XXS:
    case WEIGHT_IQ2_XS:
    case WEIGHT_IQ2_S:
    case WEIGHT_IQ3_XXS:
    case WEIGHT_IQ3_S: return grid_group(type, row, g, gs);
    default: {
        uint8_t u[32] __attribute__((aligned(32)));
        codebook_group(type, row, g, u, gs);
        return _mm256_load_si256((const __m256i *)u);
    }
    }
}

#endif
