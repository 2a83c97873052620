/* Model stage, CPU: one whole decoder layer for a decode step of up to 32 requests (bf16).
 *
 * A decode step of a few requests does little arithmetic per layer, but the PyTorch
 * path spends it in about fifty small operations (norms, rotary, splits, activations,
 * residual adds), each costing microseconds of dispatch: for a 30-layer model that is
 * milliseconds per token, as much as reading the weights. Here the layer is one call:
 *
 *   x = rms_norm(h) -> qkv = x Wqkv^T (+b) -> rotary(q, k) -> store k, v by slot (bf16, or fp8.h's
 *   rounding into an fp8 cache)
 *   -> paged decode attention -> h += attn Wo^T (+b)
 *   -> x = rms_norm(h) -> g, u = x Wgu^T -> h += (silu(g) * u) Wd^T
 *
 * Qwen3's per-head q/k norms run before rotary where the layer has them. A sparse layer
 * (Experts) routes its rows in C (router logits in float32, softmax, top-k, renormalized)
 * and runs its chosen experts through moe_experts.c's stages in this region; a shared
 * expert (Qwen2-MoE) is the layer's gate_up/down, scaled per row by the sigmoid of its gate.
 *
 * Only the matrix multiplications' inputs (norm outputs, query, attention output,
 * activation) and the KV cache are bf16; the residual stream and the projections' outputs
 * are float32 (layer_rows.h). The linear layers go through quant_linear.c's linear_weight_part (bf16 or
 * quantized weights; streaming up to 16 rows, register tiles above); the attention is paged_decode.c's.
 *
 * Built at run time by pagellm/kernels/build.py; needs AVX-512 BF16 like linear_bf16.c.
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
#include "kernels.h"
#include "layer_rows.h"
#include "layer_structs.h"

/* Context bytes each thread prefetches at the start of a layer (L2 is 1 MB or more on
 * CPUs with AVX-512 BF16; the qkv weights stream through it meanwhile). */
#define CONTEXT_PREFETCH_BYTES (256 * 1024)

/* act = bf16(silu(gate) * up) per row, gate and up being the halves of each gate_up row,
 * shared among the threads of the enclosing region (32 rows x 1536 is ~50k expf). */
static void silu_and_mul(const float *gate_up, uint16_t *act, int64_t m, int64_t inter) {
    const int64_t total = m * inter;
#pragma omp for schedule(static)
    for (int64_t index = 0; index < total; index++) {
        const int64_t r = index / inter, i = index % inter;
        act[index] = silu_mul(gate_up[r * 2 * inter + i], gate_up[r * 2 * inter + inter + i]);
    }
}

/* The MLP half of a layer, after its post-attention norm: scratch->normed (bf16 [m, hidden])
 * through the gated MLP, or the routed experts (plus the shared expert where the layer has
 * one), summed into scratch->proj (float32 [m, hidden], the layer's delta). Inside a region;
 * ends with proj complete. decode_layer_bf16 and hybrid_decode_layer.c's layer share it. */
void layer_mlp_in_region(const LayerWeights *w, const LayerShape *s, int64_t m, const Scratch *scratch, int t, int nt) {
    const int64_t h = s->hidden;
    const Experts *experts = w->experts;
    if (experts != NULL) { /* routed experts: their weighted sum into proj */
        const int64_t num_experts = experts->num_experts;
#pragma omp for schedule(static)
        for (int64_t index = 0; index < m * num_experts; index++) {
            const uint16_t *x = scratch->normed + (index / num_experts) * h;
            const float *router = experts->router + (index % num_experts) * h;
            float logit = experts->router_bias ? experts->router_bias[index % num_experts] : 0.0f;
            for (int64_t i = 0; i < h; i++) logit += bf16_to_float(x[i]) * router[i];
            scratch->router_logits[index] = logit;
        }
#pragma omp single
        route_rows(scratch->router_logits, m, num_experts, experts->top_k, experts->renormalize, scratch->offsets,
                   scratch->choice_rows, scratch->choice_scales);
        const MoeScratch moe = {scratch->gathered, scratch->gate_up, scratch->act, scratch->expert_out,
                               scratch->partials};
        moe_experts_in_region(scratch->normed, m, h, experts->width, num_experts, experts->gate_up, experts->down,
                              scratch->offsets, scratch->choice_rows, scratch->choice_scales, experts->impls,
                              scratch->proj, &moe, &experts->form, t, nt);
    }
    if (w->gate_up != NULL) { /* the MLP, or the shared expert */
        const int64_t width = w->mlp_width;
        /* A dense MLP's output is the layer's delta; a shared expert's is added to the routed sum. */
        float *mlp_out = experts != NULL ? scratch->expert_out : scratch->proj;
        linear_weight_part(scratch->normed, h, w->gate_up, NULL, scratch->gate_up, 2 * width, 1, m, h,
                           s->linear_impl[2], t, nt);
#pragma omp barrier
        silu_and_mul(scratch->gate_up, scratch->act, m, width);
        linear_weight_part(scratch->act, width, w->down, NULL, mlp_out, h, 1, m, width, s->linear_impl[3], t, nt);
#pragma omp barrier
        if (experts != NULL) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) {
                float scale = 1.0f;
                if (experts->shared_gate != NULL) {
                    float logit = 0.0f;
                    for (int64_t i = 0; i < h; i++)
                        logit += bf16_to_float(scratch->normed[r * h + i]) * experts->shared_gate[i];
                    scale = 1.0f / (1.0f + expf(-logit));
                }
                for (int64_t i = 0; i < h; i++) scratch->proj[r * h + i] += scale * mlp_out[r * h + i];
            }
        }
    }
}

/* hidden: [m, hidden] float32 (the residual stream), updated in place to the layer's output; the caches are the
 * layer's [blocks, block_size, kv_heads, head_dim] K and V, of element type s->cache_type. One parallel region for the
 * whole layer: each thread streams its share of every weight matrix, with barriers
 * between the phases, instead of a fork and join per operation. */
void decode_layer_bf16(float *hidden, const LayerWeights *w, void *key_cache, void *value_cache,
                       const LayerShape *s, const StepInputs *in, const Scratch *scratch) {
    const int64_t m = in->m, h = s->hidden;
    const QkNorm qk_norm = {w->q_norm, w->k_norm, s->eps};
    const int64_t q_size = (int64_t)s->num_heads * s->head_dim;
    const int64_t kv_size = (int64_t)s->num_kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int half = s->head_dim / 2;

#pragma omp parallel num_threads(s->num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        paged_decode_prefetch_in_region(key_cache, value_cache, in->block_tables, in->table_stride, in->reqs,
                                        in->seq_lens, m, s->num_kv_heads, s->head_dim, s->block_size,
                                        elem_bytes(s->cache_type), t, nt,
                                        CONTEXT_PREFETCH_BYTES);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            rms_norm_row(hidden + r * h, NULL, w->input_norm, s->eps, scratch->normed + r * h, h);
        linear_weight_part(scratch->normed, h, w->qkv, w->qkv_bias, scratch->qkv, qkv_size, 1, m, h, s->linear_impl[0], t,
                           nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            const float *cos = w->no_rope ? NULL : in->cos_table + in->positions[r] * half;
            const float *sin = w->no_rope ? NULL : in->sin_table + in->positions[r] * half;
            rotate_and_store_row(scratch->qkv + r * qkv_size, s->num_heads, s->num_kv_heads, s->head_dim, qk_norm, cos, sin,
                                 scratch->query + r * q_size, in->slots[r], key_cache, value_cache, s->cache_type,
                                 scratch->kv_row + r * 2 * kv_size);
        }
        paged_decode_attention_in_region(scratch->query, q_size, key_cache, value_cache, in->block_tables,
                                         in->table_stride, in->rows, in->reqs, in->seq_lens, in->key_starts, m, s->num_heads,
                                         s->num_kv_heads, s->head_dim, s->block_size, s->scale, 0.0f, w->sinks, ELEM_BF16,
                                         s->cache_type, nt,
                                         in->max_seq_len, scratch->attn, q_size, scratch->attn_scratch);
        linear_weight_part(scratch->attn, q_size, w->o, w->o_bias, scratch->proj, h, 1, m, q_size, s->linear_impl[1], t,
                           nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)  /* residual add, then the norm */
            rms_norm_row(hidden + r * h, scratch->proj + r * h, w->post_norm, s->eps, scratch->normed + r * h, h);
        layer_mlp_in_region(w, s, m, scratch, t, nt);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m * h; i++) hidden[i] += scratch->proj[i];
        float_mode_restore(float_mode);
    }
}
