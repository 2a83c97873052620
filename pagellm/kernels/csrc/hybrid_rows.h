/* One row's worth of Qwen3.5's hybrid-layer stages (model/qwen3_5.py), shared by the per-stage
 * calls (hybrid_layer_ops.c) and the one-call decode layer (hybrid_decode_layer.c), with
 * layer_rows.h's precision: float32 in, each bf16 output rounded once. */
#ifndef PAGELLM_HYBRID_ROWS_H
#define PAGELLM_HYBRID_ROWS_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "fp8.h"

static inline float inverse_rms(const float *x, int64_t n, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* row += delta (when delta is not NULL), then out = bf16(scale * row * rsqrt(mean(row^2) + eps)),
 * scale float32 (Qwen3.5's 1 + w, the sum taken in float32 as the reference does). */
static inline void scaled_rms_norm_row(float *row, const float *delta, const float *scale, float eps, uint16_t *out,
                                       int64_t h) {
    if (delta != NULL)
        for (int64_t i = 0; i < h; i++) row[i] += delta[i];
    const float inverse = inverse_rms(row, h, eps);
    for (int64_t i = 0; i < h; i++) out[i] = float_to_bf16(scale[i] * (row[i] * inverse));
}

/* One value head of a Gated DeltaNet's output: bf16(weight * x * rsqrt(mean(x^2) + eps) * silu(gate)). */
static inline void gated_rms_norm_head(const float *x, const float *gate, const float *weight, float eps, uint16_t *out,
                                       int64_t dim) {
    const float inverse = inverse_rms(x, dim, eps);
    for (int64_t i = 0; i < dim; i++)
        out[i] = float_to_bf16(weight[i] * (x[i] * inverse) * (gate[i] / (1.0f + expf(-gate[i]))));
}

/* One head in place: x = scale * x * rsqrt(mean(x^2) + eps), then its first 2 * half
 * values rotated (half-split, HF layout) by cos/sin [half]; written to out as bf16. */
static inline void norm_rotate_head(float *x, int head_dim, const float *scale, float eps, const float *cos,
                                    const float *sin, int half, uint16_t *out) {
    const float inverse = inverse_rms(x, head_dim, eps);
    for (int i = 0; i < head_dim; i++) x[i] = scale[i] * (x[i] * inverse);
    for (int i = 0; i < half; i++) {
        out[i] = float_to_bf16(x[i] * cos[i] - x[i + half] * sin[i]);
        out[i + half] = float_to_bf16(x[i + half] * cos[i] + x[i] * sin[i]);
    }
    for (int i = 2 * half; i < head_dim; i++) out[i] = float_to_bf16(x[i]);
}

/* Gated attention's q, k and v from one float32 row of its projection, [q head 0 | gate
 * head 0 | q head 1 | ... | k | v]: q and k normalized per head (q_scale, k_scale: float32
 * [head_dim], 1 + w) and their first 2 * half values rotated; q to query (bf16 [num_heads
 * * head_dim]), k and v to the caches at `slot` (skipped if slot < 0; cache_type, fp8.h).
 * kv_row: 2 * num_kv_heads * head_dim scratch. The gates stay in the row. */
static inline void gated_query_store_row(float *row, int num_heads, int num_kv_heads, int head_dim, int half,
                                         const float *cos, const float *sin, const float *q_scale,
                                         const float *k_scale, float eps, uint16_t *query, int64_t slot,
                                         void *key_cache, void *value_cache, int cache_type, uint16_t *kv_row) {
    const int64_t kv_size = (int64_t)num_kv_heads * head_dim;
    const int64_t k_offset = 2 * (int64_t)num_heads * head_dim;
    for (int h = 0; h < num_heads; h++)
        norm_rotate_head(row + (int64_t)h * 2 * head_dim, head_dim, q_scale, eps, cos, sin, half,
                         query + (int64_t)h * head_dim);
    if (slot < 0) return;
    for (int h = 0; h < num_kv_heads; h++)
        norm_rotate_head(row + k_offset + (int64_t)h * head_dim, head_dim, k_scale, eps, cos, sin, half,
                         kv_row + (int64_t)h * head_dim);
    for (int64_t i = 0; i < kv_size; i++) kv_row[kv_size + i] = float_to_bf16(row[k_offset + kv_size + i]);
    store_bf16_row(key_cache, slot * kv_size, kv_row, kv_size, cache_type);
    store_bf16_row(value_cache, slot * kv_size, kv_row + kv_size, kv_size, cache_type);
}

/* One row: out = bf16(attn * sigmoid(gate)), each head's gate the second half of its q rows in `row`. */
static inline void sigmoid_gate_row(const uint16_t *attn, const float *row, int num_heads, int head_dim,
                                    uint16_t *out) {
    for (int h = 0; h < num_heads; h++) {
        const float *gate = row + (int64_t)h * 2 * head_dim + head_dim;
        const int64_t base = (int64_t)h * head_dim;
        for (int i = 0; i < head_dim; i++) out[base + i] = float_to_bf16(bf16_to_float(attn[base + i]) / (1.0f + expf(-gate[i])));
    }
}

#endif
