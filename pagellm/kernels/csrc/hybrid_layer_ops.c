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
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "float_mode.h"
#include "hybrid_rows.h"

/* hidden += delta (when delta is not NULL), then out = bf16(scale * hidden * rsqrt(mean(hidden^2) + eps)).
 * scale is float32 [h]: Qwen3.5's norms scale by 1 + w, the sum taken in float32 as the
 * reference does (a bf16 weight row would round it). hidden, delta: [m, h] float32. */
void scaled_rms_norm_residual(float *hidden, const float *delta, const float *scale, float eps, uint16_t *out,
                              int64_t m, int64_t h, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            scaled_rms_norm_row(hidden + r * h, delta != NULL ? delta + r * h : NULL, scale, eps, out + r * h, h);
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
            gated_rms_norm_head(core + index * dim, z + r * z_stride + head * dim, weight, eps, out + index * dim, dim);
        }
        float_mode_restore(float_mode);
    }
}

/* Gated attention's q, k and v from each float32 row of its projection (row stride
 * `stride`), as hybrid_rows.h gated_query_store_row: q to query ([m, num_heads * head_dim]
 * bf16), k and v to the caches ([blocks * block_size, num_kv_heads * head_dim] of
 * cache_type) at the row's slot; cos/sin tables [positions, rotary_dim / 2]. */
void gated_query_store(float *qkv, int64_t m, int64_t stride, const int64_t *positions, const float *cos_table,
                       const float *sin_table, int num_heads, int num_kv_heads, int head_dim, int rotary_dim,
                       const float *q_scale, const float *k_scale, float eps, const int64_t *slots, uint16_t *query,
                       void *key_cache, void *value_cache, int cache_type, int num_threads) {
    const int64_t kv_size = (int64_t)num_kv_heads * head_dim;
    const int half = rotary_dim / 2;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        uint16_t kv_row[2 * kv_size];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            gated_query_store_row(qkv + r * stride, num_heads, num_kv_heads, head_dim, half,
                                  cos_table + positions[r] * half, sin_table + positions[r] * half, q_scale, k_scale,
                                  eps, query + r * num_heads * head_dim, slots[r], key_cache, value_cache, cache_type,
                                  kv_row);
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
        for (int64_t r = 0; r < m; r++) sigmoid_gate_row(attn + r * q_size, qkv + r * stride, num_heads, head_dim, out + r * q_size);
        float_mode_restore(float_mode);
    }
}
