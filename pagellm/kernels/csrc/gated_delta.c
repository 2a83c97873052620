/* Model stage, CPU: one decode step of a Gated DeltaNet layer (model/qwen3_5.py) for every
 * decoding request of a step, on each request's recurrent-state slot in place.
 *
 * In PyTorch a decode step gathers the slots' states, decays them, reads them (k S),
 * writes the update, reads them again (q S) and scatters them back: about seven passes
 * over a state that is 64 KiB per value head, 1 MiB per request and layer at Qwen3.5's
 * shapes, so at 32 requests the step streams hundreds of MiB. Here each (request, value
 * head) reads its key x value matrix once to predict (k S), then updates it and reads the
 * output (q S) in a second pass that finds it in the core's cache: one read and one write
 * from memory. The short convolution, the q/k L2 norms and the gates come first, in one
 * pass per request.
 *
 * causal_conv_run is a prefill run's short convolution (one request's tokens, continuing
 * from its conv state) with SiLU, in one pass over the tokens: PyTorch's depthwise conv1d
 * and the concatenation and transposes around it stream the run's channels several times.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "float_mode.h"
#include "kernels.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* torch.nn.functional.softplus (beta 1, threshold 20). */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Scale each of `heads` vectors of `dim` to unit length as the model's _l2_normalized
 * (x * rsqrt(sum(x^2) + 1e-6)), times `scale`. */
static void l2_normalize(float *x, int64_t heads, int64_t dim, float scale) {
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) sum += v[i] * v[i];
        const float factor = scale / sqrtf(sum + 1e-6f);
        for (int64_t i = 0; i < dim; i++) v[i] *= factor;
    }
}

/* rows: R decoding requests; slots: their state slots (int64 [R]).
 * mixed: [R, conv_dim] float32 rows of `mixed_stride`, the input projection's q | k | v
 * channels before the conv; b, a: [R, value_heads] float32 rows of `gate_stride`, beta's
 * and the decay's inputs.
 * conv_weight: [conv_dim, kernel] float32; conv_states: [slots, conv_dim, kernel - 1]
 * float32 (the last inputs, oldest first; replaced); states: [slots, value_heads,
 * key_dim, value_dim] float32 (updated). a_log, dt_bias: [value_heads] float32.
 * tiled: value head p reads key head p % key_heads (else p / (value_heads / key_heads)).
 * out: [R, value_heads, value_dim] float32; scratch: [R, conv_dim] float32.
 * Inside a parallel region (kernels.h); every thread calls it, and it ends with the
 * states and out complete (the worksharing loops' barriers). */
void gated_delta_decode_in_region(const float *mixed, int64_t mixed_stride, const float *b, const float *a,
                                  int64_t gate_stride, const float *conv_weight, float *conv_states, float *states,
                                  const int64_t *slots, const float *a_log, const float *dt_bias, int64_t rows,
                                  int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim,
                                  int64_t kernel, int tiled, float *out, float *scratch) {
    const int64_t conv_dim = 2 * key_heads * key_dim + value_heads * value_dim;
    const int64_t history = kernel - 1;
    const int64_t per_key = value_heads / key_heads;
    /* The conv step, SiLU, and the q/k norms, one request at a time. */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *conv_state = conv_states + slots[r] * conv_dim * history;
        const float *x = mixed + r * mixed_stride;
        float *y = scratch + r * conv_dim;
        for (int64_t c = 0; c < conv_dim; c++) {
            float *past = conv_state + c * history;
            const float *w = conv_weight + c * kernel;
            float sum = w[history] * x[c];
            for (int64_t j = 0; j < history; j++) sum += w[j] * past[j];
            if (history > 0) {
                memmove(past, past + 1, (size_t)(history - 1) * sizeof(float));
                past[history - 1] = x[c];
            }
            y[c] = silu(sum);
        }
        l2_normalize(y, key_heads, key_dim, 1.0f / sqrtf((float)key_dim));
        l2_normalize(y + key_heads * key_dim, key_heads, key_dim, 1.0f);
    }
    /* The delta rule, one (request, value head) at a time. */
#pragma omp for schedule(static) collapse(2)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t p = 0; p < value_heads; p++) {
            const int64_t key_head = tiled ? p % key_heads : p / per_key;
            const float *y = scratch + r * conv_dim;
            const float *q = y + key_head * key_dim;
            const float *k = y + (key_heads + key_head) * key_dim;
            const float *v = y + 2 * key_heads * key_dim + p * value_dim;
            const float beta = 1.0f / (1.0f + expf(-b[r * gate_stride + p]));
            const float decay = expf(-expf(a_log[p]) * softplus(a[r * gate_stride + p] + dt_bias[p]));
            float *s = states + ((slots[r] * value_heads + p) * key_dim) * value_dim;
            float predicted[value_dim], written[value_dim], o[value_dim];
            memset(predicted, 0, sizeof(predicted));
            memset(o, 0, sizeof(o));
            for (int64_t i = 0; i < key_dim; i++) {
                const float ki = k[i];
                const float *row = s + i * value_dim;
                for (int64_t j = 0; j < value_dim; j++) predicted[j] += ki * row[j];
            }
            for (int64_t j = 0; j < value_dim; j++) written[j] = beta * (v[j] - decay * predicted[j]);
            for (int64_t i = 0; i < key_dim; i++) {
                const float ki = k[i], qi = q[i];
                float *row = s + i * value_dim;
                for (int64_t j = 0; j < value_dim; j++) {
                    const float updated = decay * row[j] + ki * written[j];
                    row[j] = updated;
                    o[j] += qi * updated;
                }
            }
            memcpy(out + (r * value_heads + p) * value_dim, o, sizeof(o));
        }
    }
}

/* The decode step of every decoding request as one call (attention/gated_delta_decode.py):
 * contiguous mixed [R, conv_dim] and b, a [R, value_heads]; the rest as above. */
void gated_delta_decode(const float *mixed, const float *b, const float *a, const float *conv_weight,
                        float *conv_states, float *states, const int64_t *slots, const float *a_log,
                        const float *dt_bias, int64_t rows, int64_t key_heads, int64_t value_heads, int64_t key_dim,
                        int64_t value_dim, int64_t kernel, int tiled, float *out, float *scratch, int num_threads) {
    const int64_t conv_dim = 2 * key_heads * key_dim + value_heads * value_dim;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        gated_delta_decode_in_region(mixed, conv_dim, b, a, value_heads, conv_weight, conv_states, states, slots, a_log,
                                     dt_bias, rows, key_heads, value_heads, key_dim, value_dim, kernel, tiled, out,
                                     scratch);
        float_mode_restore(float_mode);
    }
}

/* Value columns a prefill run's work item keeps: its [key_dim, 32] slice of a head's state
 * is 16 KiB at key_dim 128, resident in L1 for the whole run, and each row's multiply-adds
 * run in two (AVX-512) or four (AVX2) independent vectors. 32 measured 1.3x 16 columns
 * (their one chain of dependent multiply-adds per column bounds the loop) and as fast as
 * 64 (Zen 4, Qwen3.5's 16 heads of 128 x 128, 64-512 tokens: ~55 GFLOP/s on 2 cores). */
#define RUN_VALUE_BLOCK 32

/* One request's run of `tokens` through the gated delta rule, token after token (the
 * recurrent form, as the decode step), from the state before the first token.
 * q, k: [tokens, heads, key_dim] float32 (q L2-normalized and scaled, k L2-normalized, one
 * per value head); v: [tokens, heads, value_dim]; g: [tokens, heads], the log of the decay;
 * beta: [tokens, heads]; state: [heads, key_dim, value_dim] float32, updated to the state
 * after the last token; out: [tokens, heads, value_dim].
 * Each (head, block of 32 value columns) is one work item that carries its slice of the
 * state through every token: the slice is read from and written to memory once per run,
 * and each token costs two passes over it in L1 (predict k S, then update and read q S).
 * PyTorch's chunked form instead solves a triangular system per 64 tokens and head in a
 * few dozen small operations. */
void gated_delta_prefill_run(const float *q, const float *k, const float *v, const float *g, const float *beta,
                             float *state, int64_t tokens, int64_t heads, int64_t key_dim, int64_t value_dim,
                             float *out, int num_threads) {
    const int64_t blocks = (value_dim + RUN_VALUE_BLOCK - 1) / RUN_VALUE_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        float slice[key_dim][RUN_VALUE_BLOCK]; /* 16 KiB at key_dim 128: on the thread's stack */
#pragma omp for schedule(static) collapse(2)
        for (int64_t p = 0; p < heads; p++) {
            for (int64_t block = 0; block < blocks; block++) {
                const int64_t j0 = block * RUN_VALUE_BLOCK;
                const int64_t width = value_dim - j0 < RUN_VALUE_BLOCK ? value_dim - j0 : RUN_VALUE_BLOCK;
                float *s = state + p * key_dim * value_dim + j0;
                for (int64_t i = 0; i < key_dim; i++)
                    for (int64_t j = 0; j < RUN_VALUE_BLOCK; j++) slice[i][j] = j < width ? s[i * value_dim + j] : 0.0f;
                for (int64_t t = 0; t < tokens; t++) {
                    const int64_t at = t * heads + p;
                    const float *kt = k + at * key_dim, *qt = q + at * key_dim, *vt = v + at * value_dim + j0;
                    const float decay = expf(g[at]), bt = beta[at];
                    float predicted[RUN_VALUE_BLOCK] = {0}, written[RUN_VALUE_BLOCK], o[RUN_VALUE_BLOCK] = {0};
                    for (int64_t i = 0; i < key_dim; i++)
                        for (int64_t j = 0; j < RUN_VALUE_BLOCK; j++) predicted[j] += kt[i] * slice[i][j];
                    for (int64_t j = 0; j < RUN_VALUE_BLOCK; j++)
                        written[j] = j < width ? bt * (vt[j] - decay * predicted[j]) : 0.0f;
                    for (int64_t i = 0; i < key_dim; i++) {
                        const float ki = kt[i], qi = qt[i];
                        for (int64_t j = 0; j < RUN_VALUE_BLOCK; j++) {
                            const float updated = decay * slice[i][j] + ki * written[j];
                            slice[i][j] = updated;
                            o[j] += qi * updated;
                        }
                    }
                    float *ot = out + at * value_dim + j0;
                    for (int64_t j = 0; j < width; j++) ot[j] = o[j];
                }
                for (int64_t i = 0; i < key_dim; i++)
                    for (int64_t j = 0; j < width; j++) s[i * value_dim + j] = slice[i][j];
            }
        }
        float_mode_restore(float_mode);
    }
}

/* One request's run of `tokens` through the causal depthwise convolution, continuing from
 * the inputs its state holds, then SiLU.
 * x: [tokens, channels] with row stride x_stride, bfloat16 (x_f32 0) or float32;
 * weight: [channels, kernel] float32; conv_state: [channels, kernel - 1] float32 (the last
 * inputs, oldest first; replaced by the run's last ones); out: [tokens, channels] float32.
 * Token t's output is sum_j weight[c, j] * input(t - (kernel - 1) + j), the inputs before
 * the run coming from the state. Threads take tokens; each token's loops run along the
 * channels (contiguous), so that they vectorize, SiLU's exp included. */
static inline float conv_input(const void *x, int x_f32, int64_t at) {
    return x_f32 ? ((const float *)x)[at] : bf16_to_float(((const uint16_t *)x)[at]);
}

void causal_conv_run(const void *x, int x_f32, int64_t x_stride, int64_t tokens, int64_t channels,
                     const float *weight, float *conv_state, int64_t kernel, float *out, int num_threads) {
    const int64_t history = kernel - 1;
    float *taps = malloc((size_t)(kernel * channels) * sizeof(float)); /* [kernel, channels] */
    if (taps == NULL) return;
    for (int64_t c = 0; c < channels; c++)
        for (int64_t j = 0; j < kernel; j++) taps[j * channels + c] = weight[c * kernel + j];
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            float *o = out + t * channels;
            const float *current = taps + history * channels;
            for (int64_t c = 0; c < channels; c++) o[c] = current[c] * conv_input(x, x_f32, t * x_stride + c);
            for (int64_t j = 0; j < history; j++) {
                const int64_t source = t - history + j;
                const float *w = taps + j * channels;
                if (source >= 0) {
                    for (int64_t c = 0; c < channels; c++) o[c] += w[c] * conv_input(x, x_f32, source * x_stride + c);
                } else { /* before the run: from the state */
                    for (int64_t c = 0; c < channels; c++) o[c] += w[c] * conv_state[c * history + history + source];
                }
            }
            for (int64_t c = 0; c < channels; c++) o[c] = o[c] / (1.0f + expf(-o[c]));
        }
        float_mode_restore(float_mode);
    }
    /* The new state, once every read of the old one is done: the last `history` inputs (for
     * a run shorter than that, the old state's later entries first; entry j reads entry
     * tokens + j >= j, not yet overwritten). */
    for (int64_t c = 0; c < channels; c++) {
        float *past = conv_state + c * history;
        for (int64_t j = 0; j < history; j++) {
            const int64_t source = tokens - history + j;
            past[j] = source >= 0 ? conv_input(x, x_f32, source * x_stride + c) : past[history + source];
        }
    }
    free(taps);
}
