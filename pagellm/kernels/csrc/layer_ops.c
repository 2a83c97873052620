/* Model stage, CPU: the elementwise parts of a decoder layer for bf16 steps of any size.
 *
 * Steps that the one-call decode layer (decode_layer.c) does not take (more decodes than
 * it is measured to win at, prefill chunks) run their matrix multiplications one call
 * each (the measured choice of kernels/linear_choice.py), but PyTorch spends about 40 more operations per layer on the norms,
 * rotary embedding, cache writes, activation and residual adds: at 128 decodes that was
 * about 10 ms of a 72 ms step (measured). Each function below is one of those stages in
 * one pass over the rows, split among the threads, with layer_rows.h's precision (a
 * float32 residual stream, bf16 only where a matrix multiplication reads).
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
#include "layer_rows.h"

/* hidden += delta (when delta is not NULL), then out = bf16(weight * hidden * rsqrt(mean(hidden^2) + eps)),
 * as model/layers.py RMSNorm after the residual add. hidden, delta: [m, h] float32; out [m, h] bf16. */
void rms_norm_residual(float *hidden, const float *delta, const uint16_t *weight, float eps, uint16_t *out,
                       int64_t m, int64_t h, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            rms_norm_row(hidden + r * h, delta != NULL ? delta + r * h : NULL, weight, eps, out + r * h, h);
        float_mode_restore(float_mode);
    }
}

/* Rotary on the q and k heads of each float32 qkv row ([q | k | v], row stride `stride`),
 * after Qwen3's per-head q/k norms where q_norm and k_norm are not NULL (in place): q into query ([m, num_heads * head_dim] bf16), k and v written to the cache at the row's
 * slot (a slot < 0 is skipped). Caches: [blocks * block_size, num_kv_heads * head_dim] of
 * cache_type (fp8.h: bf16, or fp8 rounded to nearest even and saturated). */
void rotary_store(float *qkv, int64_t m, int64_t stride, const int64_t *positions, const float *cos_table,
                  const float *sin_table, int num_heads, int num_kv_heads, int head_dim, const uint16_t *q_norm,
                  const uint16_t *k_norm, float eps, const int64_t *slots, uint16_t *query, void *key_cache,
                  void *value_cache, int cache_type, int num_threads) {
    const QkNorm qk_norm = {q_norm, k_norm, eps};
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    const int half = head_dim / 2;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        uint16_t kv_row[2 * kv_size];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            /* NULL tables: a layer without rotary (rotate_heads leaves the heads as they are) */
            const float *cos = cos_table ? cos_table + positions[r] * half : NULL;
            const float *sin = sin_table ? sin_table + positions[r] * half : NULL;
            rotate_and_store_row(qkv + r * stride, num_heads, num_kv_heads, head_dim, qk_norm, cos, sin, query + r * q_size,
                                 slots[r], key_cache, value_cache, cache_type, kv_row);
        }
        float_mode_restore(float_mode);
    }
}

/* act = bf16(silu(gate) * up) for each float32 row of gate_up = [gate | up]: [m, 2 * inter]. */
void silu_mul_rows(const float *gate_up, uint16_t *act, int64_t m, int64_t inter, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
            uint16_t *dst = act + r * inter;
            for (int64_t i = 0; i < inter; i++) dst[i] = silu_mul(gate[i], up[i]);
        }
        float_mode_restore(float_mode);
    }
}

/* n bf16 values -> n fp8 bytes of `type` (fp8.h), as the cache stores them (the tests
 * compare it with torch's cast). */
void bf16_to_fp8_rows(const uint16_t *src, uint8_t *dst, int64_t n, int type) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_fp8(src[i], type);
}
