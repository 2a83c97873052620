/* Model stage, CPU: the structures Python fills for decode_layer.c's one-call layer.
 *
 * pagellm/kernels/abi.py mirrors each with ctypes; abi.c exports their sizes and field
 * offsets, and loading the library refuses a mirror that differs (a field added, moved or
 * retyped on one side only). Change both sides together.
 */
#ifndef PAGELLM_LAYER_STRUCTS_H
#define PAGELLM_LAYER_STRUCTS_H

#include <stdint.h>

#include "weights.h"

/* What a family's experts add to the gated MLP (NULL: nothing): biases on each expert's gate_up
 * and down, and gpt-oss's clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)
 * with g = min(gate, limit), in place of silu(gate) * up. */
typedef struct {
    const uint16_t *const *gate_up_bias; /* [experts] bf16 [2 width] each, or NULL */
    const uint16_t *const *down_bias;    /* [experts] bf16 [hidden] each, or NULL */
    float swiglu_limit;                  /* > 0: the clamped SwiGLU; 0: silu(gate) * up */
    float swiglu_alpha;
} ExpertForm;

typedef struct {
    const float *router;          /* [num_experts, hidden] float32 */
    const Weight *const *gate_up; /* [num_experts] Weight* of [2 width, hidden] */
    const Weight *const *down;    /* [num_experts] Weight* of [hidden, width] */
    const int32_t *impls;         /* [(MAX_ROWS + 1) * 2]: gate_up's and down's kernel at each row count */
    const float *shared_gate;     /* [hidden] float32: the shared expert's gate, or NULL (none, or not gated) */
    int64_t num_experts, width;
    int top_k, renormalize;
    const float *router_bias;     /* [num_experts] float32, or NULL (gpt-oss's router has one) */
    ExpertForm form;              /* kernels.h: the experts' biases and clamped SwiGLU (gpt-oss), or none */
} Experts;

typedef struct {
    const uint16_t *input_norm, *post_norm;  /* [hidden] */
    const uint16_t *q_norm, *k_norm;         /* [head_dim] or NULL (Qwen3's per-head norms) */
    const Weight *qkv;                       /* [q + 2 kv, hidden] (weights.h: bf16 or quantized) */
    const uint16_t *qkv_bias;                /* [q + 2 kv] or NULL */
    const Weight *o;                         /* [hidden, q] */
    const uint16_t *o_bias;                  /* [hidden] or NULL */
    const Weight *gate_up, *down;            /* [2 width, hidden], [hidden, width]: the MLP, a sparse layer's
                                                shared expert, or NULL (a sparse layer without one) */
    int64_t mlp_width;
    const Experts *experts;                  /* a sparse layer's routed experts, or NULL */
    int no_rope;                             /* 1: q and k are not rotated (a NoPE layer) */
    const float *sinks;                      /* [heads] float32: attention sinks (gpt-oss), or NULL */
} LayerWeights;

typedef struct {
    int64_t hidden;
    int num_heads, num_kv_heads, head_dim, block_size;
    float eps, scale;
    int num_threads;
    int cache_type;  /* fp8.h ELEM_BF16 or an fp8 type */
    int linear_impl[4]; /* kernels.h LINEAR_* of qkv, o, gate_up, down: the measured choice for this step's rows */
} LayerShape;

typedef struct {
    int64_t m;                      /* requests, one token each */
    const int64_t *positions;       /* [m] */
    const int64_t *slots;           /* [m] cache slot of the new token */
    const int64_t *block_tables;    /* [reqs, table_stride] */
    int64_t table_stride;
    const int64_t *rows, *reqs;     /* [m]: 0..m-1 and each row's block table row */
    const int64_t *seq_lens;        /* [m] context including the new token */
    int64_t max_seq_len;
    const float *cos_table, *sin_table;  /* [max_positions, head_dim / 2] */
    const int64_t *key_starts;      /* [m] the first position each row attends to (a sliding window), or NULL */
} StepInputs;

typedef struct {
    uint16_t *normed;     /* [m, hidden] */
    float *qkv;           /* [m, q + 2 kv] */
    uint16_t *query;      /* [m, q] rotated */
    uint16_t *attn;       /* [m, q] */
    float *proj;          /* [m, hidden] */
    float *gate_up;       /* [m, 2 width] (the widest MLP or expert) */
    uint16_t *act;        /* [m, width] */
    uint16_t *kv_row;     /* [m, 2 kv]: one row's k and v as bf16 on their way to the cache */
    float *attn_scratch;  /* paged_decode_attention's workspace */
    /* Sparse layers: */
    float *router_logits; /* [m, num_experts] */
    int64_t *offsets;     /* [num_experts + 1] */
    int64_t *choice_rows; /* [m * top_k] */
    float *choice_scales; /* [m * top_k] */
    uint16_t *gathered;   /* [m, hidden] */
    float *expert_out;    /* [m, hidden] */
    float *partials;      /* [threads, m, hidden] */
    /* Hybrid layers' Gated DeltaNet (hybrid_decode_layer.c): */
    float *mixer_conv;    /* [m, conv_dim]: the convolved q | k | v */
    float *mixer_core;    /* [m, value_heads * value_dim]: the delta rule's output */
} Scratch;

/* A Gated DeltaNet (Qwen3.5's linear attention) as hybrid_decode_layer.c computes it. */
typedef struct {
    const Weight *in_proj;       /* [conv_dim + value + 2 value_heads, hidden]: q | k | v, z, b, a */
    const Weight *out_proj;      /* [hidden, value] */
    const float *conv_weight;    /* [conv_dim, kernel] */
    const float *a_log, *dt_bias; /* [value_heads] */
    const float *norm_weight;    /* [value_dim]: the gated norm's */
    float *conv_states;          /* [slots, conv_dim, kernel - 1]: the worker's state slots */
    float *states;               /* [slots, value_heads, key_dim, value_dim] */
    int64_t key_heads, value_heads, key_dim, value_dim, kernel;
    int tiled;                   /* value head p reads key head p % key_heads (else p / (value_heads / key_heads)) */
} LinearMixer;

/* A hybrid decoder layer (Qwen3.5): a Gated DeltaNet or gated attention, then the MLP or experts. */
typedef struct {
    LayerWeights layer;          /* gated attention's qkv (q and its gate interleaved per head) and o, the MLP or
                                    experts; its bf16 norms are not read (the scales below are) */
    const float *input_scale, *post_scale; /* [hidden] float32: 1 + w of the layer's norms */
    const float *q_scale, *k_scale;        /* [head_dim] float32: 1 + w (gated attention) */
    const LinearMixer *mixer;              /* the Gated DeltaNet, or NULL (gated attention) */
    int rotary_dim;
} HybridLayer;

#endif
