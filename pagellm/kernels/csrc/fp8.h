/* KV cache element types of the CPU kernels, and the scalar 8-bit float conversions.
 *
 * ELEM_* are the codes pagellm/attention/kv_cache_dtype.py passes (ELEMENT_TYPES). An
 * fp8 cache holds torch.float8_e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits;
 * largest finite 448; no inf, 0x7f/0xff are NaN) or torch.float8_e5m2 (5 exponent bits of
 * bias 15, 2 mantissa bits; largest finite 57344). Stores round to nearest even (as
 * torch's cast) and saturate to the largest finite value (per-tensor scale 1.0), so a
 * cache never holds NaN or inf.
 *
 * Both directions work on the integer bits: the kernels run with subnormal floats
 * flushed (float_mode.h), and fp8's small values would be subnormal in float
 * arithmetic scaled to their range.
 */
#ifndef PAGELLM_FP8_H
#define PAGELLM_FP8_H

#include <stdint.h>
#include <string.h>

enum { ELEM_F32 = 0, ELEM_BF16 = 1, ELEM_FP8_E4M3 = 2, ELEM_FP8_E5M2 = 3 };

static inline int elem_bytes(int type) { return type == ELEM_F32 ? 4 : type == ELEM_BF16 ? 2 : 1; }

#define FP8_E4M3_MAX_BITS 0x43e00000u /* 448.0f */
#define FP8_E5M2_MAX_BITS 0x47600000u /* 57344.0f */

/* float32 bits -> an fp8 of `mant` mantissa bits and exponent bias `bias`: |x| saturated
 * at max_bits (inf and NaN included), rounded to nearest even. A mantissa that rounds up
 * past its top carries into the exponent by the addition; subnormal results (and 0)
 * come out of the same shift, one bit further per exponent step below the normal range. */
static inline uint8_t fp8_from_float_bits(uint32_t bits, int mant, int bias, uint32_t max_bits) {
    const uint32_t sign = (bits >> 24) & 0x80u;
    uint32_t a = bits & 0x7fffffffu;
    a = a > max_bits ? max_bits : a;
    const int e = (int)(a >> 23);                           /* float32 biased exponent */
    const uint32_t m = (a & 0x7fffffu) | (e ? 0x800000u : 0u); /* with the implicit bit */
    const int t = e - 127 + bias;                           /* fp8 biased exponent */
    int shift = 23 - mant + (t < 1 ? 1 - t : 0);
    shift = shift > 31 ? 31 : shift;
    const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    const uint32_t rounded = q + ((rem > half) | ((rem == half) & (q & 1u)));
    /* q holds the implicit bit (1 << mant) for normal values: exponent t - 1 plus it is t. */
    const uint32_t exponent = (uint32_t)((t < 1 ? 1 : t) - 1) << mant;
    return (uint8_t)(sign | (exponent + rounded));
}

static inline uint8_t bf16_to_fp8(uint16_t value, int type) {
    const uint32_t bits = (uint32_t)value << 16;
    return type == ELEM_FP8_E4M3 ? fp8_from_float_bits(bits, 3, 7, FP8_E4M3_MAX_BITS)
                                 : fp8_from_float_bits(bits, 2, 15, FP8_E5M2_MAX_BITS);
}

/* fp8 -> float32, exactly. */
static inline float fp8_e4m3_to_float(uint8_t x) {
    const uint32_t e = (x >> 3) & 15u, m = x & 7u;
    const uint32_t normal = ((e + 120u) << 23) | (m << 20);
    float magnitude;
    memcpy(&magnitude, &normal, sizeof magnitude);
    magnitude = e ? magnitude : (float)m * 0x1p-9f; /* subnormal: m * 2^-9 */
    return (x & 0x80u) ? -magnitude : magnitude;
}

static inline float fp8_e5m2_to_float(uint8_t x) {
    const uint32_t e = (x >> 2) & 31u, m = x & 3u;
    const uint32_t normal = ((e + 112u) << 23) | (m << 21);
    float magnitude;
    memcpy(&magnitude, &normal, sizeof magnitude);
    magnitude = e ? magnitude : (float)m * 0x1p-16f; /* subnormal: m * 2^-16 */
    return (x & 0x80u) ? -magnitude : magnitude;
}

/* n bf16 values stored at element `offset` of a cache of element type `type` (bf16:
 * copied; fp8: converted). */
static inline void store_bf16_row(void *cache, int64_t offset, const uint16_t *src, int64_t n, int type) {
    if (type == ELEM_BF16) {
        memcpy((uint16_t *)cache + offset, src, sizeof(uint16_t) * (size_t)n);
        return;
    }
    uint8_t *dst = (uint8_t *)cache + offset;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_fp8(src[i], type);
}

#endif
