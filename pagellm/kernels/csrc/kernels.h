/* The CPU kernels' functions that one source file calls in another (one declaration for
 * all callers). */
#ifndef PAGELLM_KERNELS_H
#define PAGELLM_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "layer_structs.h"
#include "weights.h"

/* The builds without AVX-512 BF16 (build.py's avx2 and avx512 levels) compute the linear
 * layers in float32 (linear_f32.c); the others with bf16 dot products (quant_linear.c). */
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGELLM_FLOAT32_LINEARS 1
#endif

/* Up to this many rows the linear layers stream their weights (small_linear.c), above it
 * they take gemm_bf16.c (measured crossover: a SmolLM2 step's linears at 16 rows 10.1 vs
 * 11.3 ms, at 20 rows 12.4 vs 10.8). */
#define STREAMING_MAX_ROWS 16

/* Which of the kernels a linear layer takes (kernels/linear_choice.py measures them):
 * LINEAR_BY_ROWS picks by the row count with the constants here and in quant_linear.c. */
enum { LINEAR_BY_ROWS = 0, LINEAR_STREAMING = 1, LINEAR_GEMM = 2, LINEAR_AMX = 4 }; /* 3, 5: oneDNN, in Python */
/* The streaming kernels with x rounded to int8 for the weight types quant_int8.c reads
 * (the opt-in int8-activation path); other parts stream as LINEAR_STREAMING. */
enum { LINEAR_STREAMING_INT8 = 6 };

static inline int impl_streams(int impl) { return impl == LINEAR_STREAMING || impl == LINEAR_STREAMING_INT8; }

/* The outputs of the linear layers are bf16 or float32 (out_f32): float32 where the value
 * goes on in float32 (the residual stream, rotary, activations, logits). */
static inline void *out_at(void *out, int64_t index, int out_f32) {
    return (char *)out + index * (out_f32 ? 4 : 2);
}

/* The [begin, end) share of `total` items that thread t of nt takes, in whole multiples of
 * `unit` (the last share may end short at total). */
static inline void thread_share(int64_t total, int64_t unit, int t, int nt, int64_t *begin, int64_t *end) {
    const int64_t units = (total + unit - 1) / unit;
    const int64_t per = units / nt, extra = units % nt;
    const int64_t first = t * per + (t < extra ? t : extra);
    const int64_t count = per + (t < extra ? 1 : 0);
    *begin = unit * first < total ? unit * first : total;
    *end = unit * (first + count) < total ? unit * (first + count) : total;
}

/* A per-thread scratch buffer of at least `bytes`, grown as needed and kept (the callers'
 * buffers are _Thread_local, and OpenMP reuses its threads). */
static inline void *grow_buffer(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        *capacity = *buffer ? bytes : 0;
    }
    return *buffer;
}

/* linear_bf16.c: thread t of nt's share of out = x w^T (+ bias), bf16, inside a region;
 * the row count picks the kernel below. */
void linear_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                      void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int impl,
                      int t, int nt);

/* small_linear.c: the same, streaming W once (up to STREAMING_MAX_ROWS rows). */
void small_linear_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                            void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t,
                            int nt);

/* gemm_bf16.c: the same for tens of rows and more (weights repacked into register tiles). */
void gemm_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                    void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t, int nt);

/* gemm_bf16.c: columns [col, col + 16 * vectors) of W [n, k] bf16 as pairs,
 * panel[(p * vectors + v) * 16 + l] = pair p of W row col + 16 v + l (rows past n zero). */
void pack_panel(const uint16_t *w, int64_t n, int64_t k, int64_t col, int vectors, uint32_t *panel);

/* gemm_amx.c: the same as gemm_bf16_part on AMX tiles, where the CPU has them and the
 * process was granted tile state (amx_supported); returns 0 when it could not run. */
int amx_supported(void);
int gemm_amx_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, void *out,
                  int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t, int nt);

/* quant_int8.c: whether it reads this weight type, and thread t of nt's share of
 * out = x W^T (+ bias) for one such part with x rounded to int8 per 32 values. */
int quant_int8_supported(int type);
void quant_int8_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                            void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt);
/* quant_int8_q8.c: the same for Q8_0 as stored (AVX-512 VNNI builds only). */
int quant_int8_q8_supported(int type);
void quant_int8_q8_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                                   void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt);
/* quant_int8_k.c: the same for the K-quants (Q2_K to Q6_K), IQ4_XS and IQ3_S as stored (AVX-512 VNNI builds only). */
int quant_int8_k_supported(int type);
void quant_int8_k_stream_part(const uint16_t *x, int64_t x_stride, const WeightPart *p, const uint16_t *bias,
                              void *out, int64_t out_stride, int out_f32, int64_t m, int64_t k, int t, int nt);

/* quant_linear.c: the bytes of one stored row of k weights of a type (-1: not a type the
 * kernels read). */
int64_t weight_row_bytes(int type, int64_t k);

/* quant_linear.c (linear_f32.c in the float32 builds): thread t of nt's share of out = x W^T (+ bias) for any Weight (bf16 or
 * quantized parts), inside a region. */
void linear_weight_part(const uint16_t *x, int64_t x_stride, const Weight *w, const uint16_t *bias, void *out,
                        int64_t out_stride, int out_f32, int64_t m, int64_t k, int impl, int t, int nt);

/* paged_decode.c: the attention rows' work items, shared among a region's threads. dtype:
 * the query's and output's element type, cache_type the cache's (fp8.h ELEM_*). */
/* Rows of one request that paged decode attention takes as one work item (see
 * paged_decode.c); its workspace is this many times larger per thread. */
#define MAX_SEGMENT_ROWS 8
int attention_segment_rows(void);

/* An attention sink's weight in the softmax denominator of head h, whose scores' maximum
 * is `top` (gpt-oss: a learned logit per head that takes probability from every key and
 * adds no value row); 0 without sinks. exp overflows to inf only where the sink outweighs
 * every key by e^88, and the output is then 0, the limit. */
static inline float sink_weight(const float *sinks, int h, float top) {
    return sinks ? expf(sinks[h] - top) : 0.0f;
}
void paged_decode_attention_in_region(
    const void *query, int64_t query_row_stride,
    const void *key_cache, const void *value_cache,
    const int64_t *block_tables, int64_t table_stride,
    const int64_t *rows, const int64_t *reqs, const int64_t *seq_lens, const int64_t *key_starts,
    int64_t num_decodes, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, float softcap, const float *sinks, int dtype, int cache_type, int num_threads, int64_t max_seq_len,
    void *out, int64_t out_row_stride, float *workspace);

/* paged_decode.c: thread t of nt's share of the step's K/V blocks, prefetched into L2. */
void paged_decode_prefetch_in_region(const void *key_cache, const void *value_cache,
                                     const int64_t *block_tables, int64_t table_stride,
                                     const int64_t *reqs, const int64_t *seq_lens, int64_t num_decodes,
                                     int num_kv_heads, int head_dim, int block_size, int element_bytes,
                                     int t, int nt, int64_t max_bytes);

/* paged_decode_bf16.c: one work item with AVX-512 BF16, where the CPU has it (bf16
 * queries; a bf16 or fp8 cache of cache_type). */
int attend_bf16_supported(int head_dim);
void attend_bf16(const uint16_t *q, const void *key_cache, const void *value_cache, int cache_type, const int64_t *table,
                 int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim,
                 int block_size, float scale, float *scores, float *acc, const int64_t *head_lens,
                 const float *sinks, int sink_period);

/* paged_decode_avx2.c: one work item in AVX2 float32 (float32 queries; a cache of cache_type;
 * a sliding window from `start`; soft-capping where softcap > 0). */
int attend_avx2_supported(int head_dim);
void attend_avx2(const float *q, const void *key_cache, const void *value_cache, const int64_t *table, int64_t start,
                 int64_t seq_len, int kv_head, int span, int num_kv_heads, int group, int head_dim, int block_size,
                 float scale, float softcap, const float *sinks, int cache_type, float *scores, float *acc);

/* moe_experts.c: a mixture-of-experts layer's experts, inside a region (see there). */
typedef struct {
    uint16_t *gathered; /* [rows, hidden] bf16: an expert's rows */
    float *gate_up;     /* [rows, 2 * width] */
    uint16_t *act;      /* [rows, width] */
    float *expert_out;  /* [rows, hidden] */
    float *partials;    /* [threads, m, hidden], or NULL: the experts are never shared out whole */
} MoeScratch;
/* Steps of up to this many rows may share out whole experts among the threads. */
#define EXPERTS_PER_THREAD_MAX_ROWS 32
void moe_experts_in_region(const uint16_t *x, int64_t m, int64_t hidden, int64_t inter, int64_t num_experts,
                           const Weight *const *gate_up, const Weight *const *down, const int64_t *offsets,
                           const int64_t *rows, const float *scales, const int32_t *impls, float *out,
                           const MoeScratch *scratch, const ExpertForm *form, int t, int nt);
void route_rows(const float *logits, int64_t m, int64_t num_experts, int top_k, int renormalize, int64_t *offsets,
                int64_t *rows, float *scales);

/* gated_delta.c: a Gated DeltaNet's decode step of every decoding request, inside a region
 * (see there). */
void gated_delta_decode_in_region(const float *mixed, int64_t mixed_stride, const float *b, const float *a,
                                  int64_t gate_stride, const float *conv_weight, float *conv_states, float *states,
                                  const int64_t *slots, const float *a_log, const float *dt_bias, int64_t rows,
                                  int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim,
                                  int64_t kernel, int tiled, float *out, float *scratch);

/* decode_layer.c: the MLP half of a layer (scratch->normed -> scratch->proj), inside a region. */
void layer_mlp_in_region(const LayerWeights *w, const LayerShape *s, int64_t m, const Scratch *scratch, int t, int nt);

#endif
