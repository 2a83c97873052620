/* bfloat16 <-> float32 for the CPU kernels: bf16 is the top half of a float32. */
#ifndef PAGELLM_BF16_H
#define PAGELLM_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) {
    /* Round to nearest even, as torch does; NaN stays NaN (quieted). A select rather
     * than a branch, so that loops over rows of values vectorize. */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* out[index] = value, out being bf16 (rounded) or float32 (out_f32). */
static inline void store_float(void *out, int64_t index, float value, int out_f32) {
    if (out_f32)
        ((float *)out)[index] = value;
    else
        ((uint16_t *)out)[index] = float_to_bf16(value);
}

#endif
