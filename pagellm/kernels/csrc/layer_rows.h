/* One row's worth of a decoder layer's elementwise stages, shared by the one-call decode
 * layer (decode_layer.c) and the per-stage calls (layer_ops.c).
 *
 * Only what a matrix multiplication reads is bf16 (the norms' outputs, the query, the
 * attention output, the activation) and the KV cache; the residual stream, the linear
 * layers' outputs, rotary and the activation's inputs stay float32, and each bf16 value
 * is rounded once. HF transformers' bf16 rounds at every stored tensor (about eleven
 * times per layer): keeping the rest in float32 is cheap, since it is all elementwise. */
#ifndef PAGELLM_LAYER_ROWS_H
#define PAGELLM_LAYER_ROWS_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "fp8.h"

/* row += delta (when delta is not NULL), then out = bf16(weight * row * rsqrt(mean(row^2) + eps)). */
static inline void rms_norm_row(float *row, const float *delta, const uint16_t *weight, float eps, uint16_t *out,
                                int64_t h) {
    if (delta != NULL)
        for (int64_t i = 0; i < h; i++) row[i] += delta[i];
    float sum = 0.0f;
    for (int64_t i = 0; i < h; i++) sum += row[i] * row[i];
    const float inverse = 1.0f / sqrtf(sum / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = float_to_bf16(bf16_to_float(weight[i]) * (row[i] * inverse));
}

/* Qwen3's per-head RMSNorm of q and k, in place in float32: each head of `head_dim` values
 * becomes weight * x * rsqrt(mean(x^2) + eps), one weight shared by every head (as
 * model/layers.py RMSNorm on float32 heads). A NULL weight leaves the heads as they are. */
static inline void rms_norm_heads(float *heads, int num_heads, int head_dim, const uint16_t *weight, float eps) {
    if (weight == NULL) return;
    for (int h = 0; h < num_heads; h++) {
        float *x = heads + (int64_t)h * head_dim;
        float sum = 0.0f;
        for (int i = 0; i < head_dim; i++) sum += x[i] * x[i];
        const float inverse = 1.0f / sqrtf(sum / (float)head_dim + eps);
        for (int i = 0; i < head_dim; i++) x[i] = bf16_to_float(weight[i]) * (x[i] * inverse);
    }
}

/* Half-split rotary (HF layout) of `num_heads` heads of one float32 row, written as bf16. */
static inline void rotate_heads(const float *heads, int num_heads, int head_dim, const float *cos, const float *sin,
                                uint16_t *out) {
    const int half = head_dim / 2;
    if (cos == NULL) { /* a layer without rotary (NoPE): the heads as projected */
        for (int64_t i = 0; i < (int64_t)num_heads * head_dim; i++) out[i] = float_to_bf16(heads[i]);
        return;
    }
    for (int h = 0; h < num_heads; h++) {
        const float *x = heads + (int64_t)h * head_dim;
        uint16_t *y = out + (int64_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            y[i] = float_to_bf16(x[i] * cos[i] - x[i + half] * sin[i]);
            y[i + half] = float_to_bf16(x[i + half] * cos[i] + x[i] * sin[i]);
        }
    }
}

/* The q/k norms of a row (QkNorm: none where q_norm is NULL). */
typedef struct {
    const uint16_t *q_norm, *k_norm; /* [head_dim] bf16 each, or NULL */
    float eps;
} QkNorm;

/* One qkv row ([q | k | v] float32): q and k normalized per head (qk_norm), q rotated into
 * query (bf16), k rotated and v stored in the caches at `slot` (cache_type, fp8.h) unless
 * slot < 0. `scratch` holds 2 * kv_size. */
static inline void rotate_and_store_row(float *qkv, int num_heads, int num_kv_heads, int head_dim, QkNorm qk_norm,
                                        const float *cos, const float *sin, uint16_t *query, int64_t slot,
                                        void *key_cache, void *value_cache, int cache_type, uint16_t *scratch) {
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    rms_norm_heads(qkv, num_heads, head_dim, qk_norm.q_norm, qk_norm.eps);
    rms_norm_heads(qkv + q_size, num_kv_heads, head_dim, qk_norm.k_norm, qk_norm.eps);
    rotate_heads(qkv, num_heads, head_dim, cos, sin, query);
    if (slot < 0) return;
    rotate_heads(qkv + q_size, num_kv_heads, head_dim, cos, sin, scratch);
    for (int64_t i = 0; i < kv_size; i++) scratch[kv_size + i] = float_to_bf16(qkv[q_size + kv_size + i]);
    store_bf16_row(key_cache, slot * kv_size, scratch, kv_size, cache_type);
    store_bf16_row(value_cache, slot * kv_size, scratch + kv_size, kv_size, cache_type);
}

/* bf16(silu(gate) * up), from float32 gate and up. */
static inline uint16_t silu_mul(float gate, float up) { return float_to_bf16(gate / (1.0f + expf(-gate)) * up); }

#endif
