/* Model stage, CPU: one whole Qwen3.5 hybrid layer (model/qwen3_5.py) for a decode step of up to
 * 20 requests (bf16), as decode_layer.c is for the Llama layer.
 *
 * The hybrid layer ops (hybrid_layer_ops.c, model/native/hybrid_layers.py) still cost ten
 * Python-side calls per layer, each a fork and join of the threads and a few microseconds of
 * Python: ~4 ms per step of a 24-layer model, a tenth of a single stream's token. Here a
 * layer is one call and one parallel region, the phases separated by barriers:
 *
 *   x = rms_norm(h) * (1 + w)
 *   Gated DeltaNet:   p = x Win^T -> conv step, gates, delta rule on the state slots
 *                     (gated_delta.c) -> y = rms_norm(core) * w * silu(z) -> h += y Wout^T
 *   gated attention:  p = x Wqkv^T -> q, k normed and partly rotated, k and v stored
 *                     -> paged decode attention -> y = attn * sigmoid(gate) -> h += y Wo^T
 *   x = rms_norm(h) * (1 + w) -> h += MLP(x) or the experts (decode_layer.c's MLP half)
 *
 * Precision as layer_rows.h: float32 residual stream, linear outputs and recurrent state;
 * bf16 only for the matmuls' inputs and the KV cache, each rounded once. Built at run time
 * by pagellm/kernels/build.py with the other kernels.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "float_mode.h"
#include "fp8.h"
#include "hybrid_rows.h"
#include "kernels.h"
#include "layer_structs.h"

/* hidden: [m, hidden] float32, updated in place to the layer's output. A Gated DeltaNet layer
 * reads and updates its mixer's state slots `state_slots` ([m] int64, one per request) and
 * has no KV cache (key_cache and value_cache unused); a gated attention layer's caches are
 * its [blocks, block_size, kv_heads, head_dim] K and V of element type s->cache_type.
 * s->linear_impl: the kernels of in_proj or qkv, out_proj or o, gate_up, down. Scratch:
 * normed, qkv (the wider projection of the two layer kinds), query, attn (the wider of q
 * and value), kv_row, proj, mixer_conv, mixer_core, and the MLP's or experts' buffers
 * (decode_layer.c). */
void hybrid_decode_layer_bf16(float *hidden, const HybridLayer *w, void *key_cache, void *value_cache,
                              const LayerShape *s, const StepInputs *in, const Scratch *scratch,
                              const int64_t *state_slots) {
    const int64_t m = in->m, h = s->hidden;
    const LinearMixer *mixer = w->mixer;
    const int64_t q_size = (int64_t)s->num_heads * s->head_dim;
    const int64_t kv_size = (int64_t)s->num_kv_heads * s->head_dim;
    int64_t projection = 2 * q_size + 2 * kv_size; /* gated attention: q and gate, k, v */
    int64_t conv_dim = 0, value_size = 0;
    if (mixer != NULL) {
        conv_dim = 2 * mixer->key_heads * mixer->key_dim + mixer->value_heads * mixer->value_dim;
        value_size = mixer->value_heads * mixer->value_dim;
        projection = conv_dim + value_size + 2 * mixer->value_heads;
    }
    const int64_t mixed_size = mixer != NULL ? value_size : q_size; /* o's or out_proj's input */
    const Weight *in_weight = mixer != NULL ? mixer->in_proj : w->layer.qkv;
    const Weight *out_weight = mixer != NULL ? mixer->out_proj : w->layer.o;
    const int half = w->rotary_dim / 2;

#pragma omp parallel num_threads(s->num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            scaled_rms_norm_row(hidden + r * h, NULL, w->input_scale, s->eps, scratch->normed + r * h, h);
        linear_weight_part(scratch->normed, h, in_weight, NULL, scratch->qkv, projection, 1, m, h, s->linear_impl[0], t,
                           nt);
#pragma omp barrier
        if (mixer != NULL) {
            const float *z = scratch->qkv + conv_dim;
            const float *b = z + value_size, *a = b + mixer->value_heads;
            gated_delta_decode_in_region(scratch->qkv, projection, b, a, projection, mixer->conv_weight,
                                         mixer->conv_states, mixer->states, state_slots, mixer->a_log, mixer->dt_bias,
                                         m, mixer->key_heads, mixer->value_heads, mixer->key_dim, mixer->value_dim,
                                         mixer->kernel, mixer->tiled, scratch->mixer_core, scratch->mixer_conv);
            const int64_t heads = mixer->value_heads, dim = mixer->value_dim;
#pragma omp for schedule(static)
            for (int64_t index = 0; index < m * heads; index++) {
                const int64_t r = index / heads, head = index % heads;
                gated_rms_norm_head(scratch->mixer_core + index * dim, z + r * projection + head * dim,
                                    mixer->norm_weight, s->eps, scratch->attn + index * dim, dim);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) {
                const float *cos = in->cos_table + in->positions[r] * half;
                const float *sin = in->sin_table + in->positions[r] * half;
                gated_query_store_row(scratch->qkv + r * projection, s->num_heads, s->num_kv_heads, s->head_dim, half,
                                      cos, sin, w->q_scale, w->k_scale, s->eps, scratch->query + r * q_size,
                                      in->slots[r], key_cache, value_cache, s->cache_type,
                                      scratch->kv_row + r * 2 * kv_size);
            }
            paged_decode_attention_in_region(scratch->query, q_size, key_cache, value_cache, in->block_tables,
                                             in->table_stride, in->rows, in->reqs, in->seq_lens, NULL, m, s->num_heads,
                                             s->num_kv_heads, s->head_dim, s->block_size, s->scale, 0.0f, NULL, ELEM_BF16,
                                             s->cache_type, nt, in->max_seq_len, scratch->attn, q_size,
                                             scratch->attn_scratch);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) /* in place, element by element */
                sigmoid_gate_row(scratch->attn + r * q_size, scratch->qkv + r * projection, s->num_heads, s->head_dim,
                                 scratch->attn + r * q_size);
        }
        linear_weight_part(scratch->attn, mixed_size, out_weight, NULL, scratch->proj, h, 1, m, mixed_size,
                           s->linear_impl[1], t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) /* residual add, then the norm */
            scaled_rms_norm_row(hidden + r * h, scratch->proj + r * h, w->post_scale, s->eps, scratch->normed + r * h, h);
        layer_mlp_in_region(&w->layer, s, m, scratch, t, nt);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m * h; i++) hidden[i] += scratch->proj[i];
        float_mode_restore(float_mode);
    }
}
