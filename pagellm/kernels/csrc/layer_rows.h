/* One row's worth of a decoder layer's elementwise stages in bf16, shared by the one-call
 * decode layer (decode_layer.c) and the per-stage calls (layer_ops.c). Values are rounded
 * to bf16 where the PyTorch path stores bf16 (model/layers.py, model/llama.py). */
#ifndef PAGELLM_LAYER_ROWS_H
#define PAGELLM_LAYER_ROWS_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

/* row += delta (when delta is not NULL), then out = weight * bf16(row * rsqrt(mean(row^2) + eps)). */
static inline void rms_norm_row(uint16_t *row, const uint16_t *delta, const uint16_t *weight, float eps,
                                uint16_t *out, int64_t h) {
    if (delta != NULL)
        for (int64_t i = 0; i < h; i++) row[i] = float_to_bf16(bf16_to_float(row[i]) + bf16_to_float(delta[i]));
    float sum = 0.0f;
    for (int64_t i = 0; i < h; i++) {
        const float v = bf16_to_float(row[i]);
        sum += v * v;
    }
    const float inverse = 1.0f / sqrtf(sum / (float)h + eps);
    for (int64_t i = 0; i < h; i++)
        out[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(row[i]) * inverse));
}

/* Half-split rotary (HF layout) of `num_heads` heads of one row, in place. */
static inline void rotate_heads(uint16_t *heads, int num_heads, int head_dim, const float *cos, const float *sin) {
    const int half = head_dim / 2;
    float x1[half], x2[half];  /* both halves read before either is written: the loops vectorize */
    for (int h = 0; h < num_heads; h++) {
        uint16_t *x = heads + (int64_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            x1[i] = bf16_to_float(x[i]);
            x2[i] = bf16_to_float(x[i + half]);
        }
        for (int i = 0; i < half; i++) {
            x[i] = float_to_bf16(x1[i] * cos[i] - x2[i] * sin[i]);
            x[i + half] = float_to_bf16(x2[i] * cos[i] + x1[i] * sin[i]);
        }
    }
}

/* bf16(silu(gate)) * up, rounded to bf16. */
static inline uint16_t silu_mul(uint16_t gate, uint16_t up) {
    const float g = bf16_to_float(gate);
    return float_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_float(up));
}

#endif
