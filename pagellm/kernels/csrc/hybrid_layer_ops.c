/* Model stage, CPU: the elementwise stages of Qwen3.5's hybrid layers (model/qwen3_5.py) for
 * bf16 steps of any size, as layer_ops.c's are for the Llama layer.
 *
 * model/native/hybrid_layers.py runs each layer as its linear layers (the measured kernels)
 * plus these calls and the Gated DeltaNet's own step (gated_delta.c): in PyTorch a hybrid
 * layer's norms, gates, rotary and splits are about 150 small operations, ~3,600 per step of
 * a 24-layer model, which at a few microseconds each cost a single stream a third of its
 * decode time. The precision is layer_rows.h's: a float32 residual stream and float32 linear
 * outputs, bf16 only where a matrix multiplication reads, each bf16 value rounded once.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "float_mode.h"
#include "fp8.h"

static inline float inverse_rms(const float *x, int64_t n, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* hidden += delta (when delta is not NULL), then out = bf16(scale * hidden * rsqrt(mean(hidden^2) + eps)).
 * scale is float32 [h]: Qwen3.5's norms scale by 1 + w, the sum taken in float32 as the
 * reference does (a bf16 weight row would round it). hidden, delta: [m, h] float32. */
void scaled_rms_norm_residual(float *hidden, const float *delta, const float *scale, float eps, uint16_t *out,
                              int64_t m, int64_t h, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            float *row = hidden + r * h;
            if (delta != NULL)
                for (int64_t i = 0; i < h; i++) row[i] += delta[r * h + i];
            const float inverse = inverse_rms(row, h, eps);
            for (int64_t i = 0; i < h; i++) out[r * h + i] = float_to_bf16(scale[i] * (row[i] * inverse));
        }
        float_mode_restore(float_mode);
    }
}

/* The gated norm on a Gated DeltaNet's output: per value head of `dim` values,
 * out = bf16(weight * x * rsqrt(mean(x^2) + eps) * silu(z)).
 * core: [m, heads * dim] float32; z: float32 rows of `z_stride` (the output gate's columns
 * of the input projection); weight: [dim] float32; out: [m, heads * dim] bf16. */
void gated_rms_norm_rows(const float *core, const float *z, int64_t z_stride, const float *weight, float eps,
                         uint16_t *out, int64_t m, int64_t heads, int64_t dim, int num_threads) {
    const int64_t total = m * heads;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
#pragma omp for schedule(static)
        for (int64_t index = 0; index < total; index++) {
            const int64_t r = index / heads, head = index % heads;
            const float *x = core + index * dim;
            const float *gate = z + r * z_stride + head * dim;
            uint16_t *y = out + index * dim;
            const float inverse = inverse_rms(x, dim, eps);
            for (int64_t i = 0; i < dim; i++)
                y[i] = float_to_bf16(weight[i] * (x[i] * inverse) * (gate[i] / (1.0f + expf(-gate[i]))));
        }
        float_mode_restore(float_mode);
    }
}

/* One head in place: x = scale * x * rsqrt(mean(x^2) + eps), then its first 2 * half
 * values rotated (half-split, HF layout) by cos/sin [half]; written to out as bf16. */
static void norm_rotate_head(float *x, int head_dim, const float *scale, float eps, const float *cos, const float *sin,
                             int half, uint16_t *out) {
    const float inverse = inverse_rms(x, head_dim, eps);
    for (int i = 0; i < head_dim; i++) x[i] = scale[i] * (x[i] * inverse);
    for (int i = 0; i < half; i++) {
        out[i] = float_to_bf16(x[i] * cos[i] - x[i + half] * sin[i]);
        out[i + half] = float_to_bf16(x[i + half] * cos[i] + x[i] * sin[i]);
    }
    for (int i = 2 * half; i < head_dim; i++) out[i] = float_to_bf16(x[i]);
}

/* Gated attention's q, k and v from each float32 row of its projection (row stride
 * `stride`): [q head 0 | gate head 0 | q head 1 | gate head 1 | ... | k | v]. q and k are
 * normalized per head (q_scale, k_scale: float32 [head_dim], 1 + w) and their first
 * rotary_dim values rotated (cos/sin tables: [positions, rotary_dim / 2]); q goes to query
 * ([m, num_heads * head_dim] bf16), k and v to the caches at the row's slot (a slot < 0 is
 * skipped; caches [blocks * block_size, num_kv_heads * head_dim] of cache_type, fp8.h). The
 * gates stay in qkv for sigmoid_gate_rows. */
void gated_query_store(float *qkv, int64_t m, int64_t stride, const int64_t *positions, const float *cos_table,
                       const float *sin_table, int num_heads, int num_kv_heads, int head_dim, int rotary_dim,
                       const float *q_scale, const float *k_scale, float eps, const int64_t *slots, uint16_t *query,
                       void *key_cache, void *value_cache, int cache_type, int num_threads) {
    const int64_t kv_size = (int64_t)num_kv_heads * head_dim;
    const int64_t k_offset = 2 * (int64_t)num_heads * head_dim;
    const int half = rotary_dim / 2;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        uint16_t kv_row[2 * kv_size];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            float *row = qkv + r * stride;
            const float *cos = cos_table + positions[r] * half, *sin = sin_table + positions[r] * half;
            for (int h = 0; h < num_heads; h++)
                norm_rotate_head(row + (int64_t)h * 2 * head_dim, head_dim, q_scale, eps, cos, sin, half,
                                 query + r * num_heads * head_dim + (int64_t)h * head_dim);
            if (slots[r] < 0) continue;
            for (int h = 0; h < num_kv_heads; h++)
                norm_rotate_head(row + k_offset + (int64_t)h * head_dim, head_dim, k_scale, eps, cos, sin, half,
                                 kv_row + (int64_t)h * head_dim);
            for (int64_t i = 0; i < kv_size; i++) kv_row[kv_size + i] = float_to_bf16(row[k_offset + kv_size + i]);
            store_bf16_row(key_cache, slots[r] * kv_size, kv_row, kv_size, cache_type);
            store_bf16_row(value_cache, slots[r] * kv_size, kv_row + kv_size, kv_size, cache_type);
        }
        float_mode_restore(float_mode);
    }
}

/* out = bf16(attn * sigmoid(gate)), each head's gate being the second half of its rows in
 * the attention's projection (gated_query_store's layout). attn, out: [m, num_heads *
 * head_dim] bf16; qkv: float32 rows of `stride`. */
void sigmoid_gate_rows(const uint16_t *attn, const float *qkv, int64_t stride, int64_t m, int num_heads, int head_dim,
                       uint16_t *out, int num_threads) {
    const int64_t q_size = (int64_t)num_heads * head_dim;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int h = 0; h < num_heads; h++) {
                const float *gate = qkv + r * stride + (int64_t)h * 2 * head_dim + head_dim;
                const int64_t base = r * q_size + (int64_t)h * head_dim;
                for (int i = 0; i < head_dim; i++)
                    out[base + i] = float_to_bf16(bf16_to_float(attn[base + i]) / (1.0f + expf(-gate[i])));
            }
        float_mode_restore(float_mode);
    }
}
