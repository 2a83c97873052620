/* Kernels stage: the layout of every structure Python fills (weights.h, layer_structs.h), exported.
 *
 * pagellm/kernels/abi.py mirrors these structures with ctypes. Nothing in C or ctypes
 * checks that the two agree, and a field one side has moved or retyped would have the C
 * code read another field's bytes. So the library lists each structure's size and each
 * field's offset, by name, and loading compares them with the mirrors and refuses a
 * difference, naming it.
 */
#include <stddef.h>
#include <stdint.h>

#include "layer_structs.h"
#include "weights.h"

typedef struct {
    const char *name; /* "Struct" (its size) or "Struct.field" (the field's offset); NULL ends the list */
    int64_t value;
} AbiEntry;

#define ABI_SIZE(T) {#T, (int64_t)sizeof(T)}
#define ABI_FIELD(T, f) {#T "." #f, (int64_t)offsetof(T, f)}

static const AbiEntry ABI_ENTRIES[] = {
    ABI_SIZE(WeightPart), ABI_FIELD(WeightPart, type), ABI_FIELD(WeightPart, rows), ABI_FIELD(WeightPart, row_bytes),
    ABI_FIELD(WeightPart, data), ABI_FIELD(WeightPart, row_scales),

    ABI_SIZE(Weight), ABI_FIELD(Weight, num_parts), ABI_FIELD(Weight, parts),

    ABI_SIZE(Experts), ABI_FIELD(Experts, router), ABI_FIELD(Experts, gate_up), ABI_FIELD(Experts, down),
    ABI_FIELD(Experts, impls), ABI_FIELD(Experts, shared_gate), ABI_FIELD(Experts, num_experts),
    ABI_FIELD(Experts, width), ABI_FIELD(Experts, top_k), ABI_FIELD(Experts, renormalize),
    ABI_FIELD(Experts, router_bias), ABI_FIELD(Experts, form),

    ABI_SIZE(ExpertForm), ABI_FIELD(ExpertForm, gate_up_bias), ABI_FIELD(ExpertForm, down_bias),
    ABI_FIELD(ExpertForm, swiglu_limit), ABI_FIELD(ExpertForm, swiglu_alpha),

    ABI_SIZE(LayerWeights), ABI_FIELD(LayerWeights, input_norm), ABI_FIELD(LayerWeights, post_norm),
    ABI_FIELD(LayerWeights, q_norm), ABI_FIELD(LayerWeights, k_norm), ABI_FIELD(LayerWeights, qkv),
    ABI_FIELD(LayerWeights, qkv_bias), ABI_FIELD(LayerWeights, o), ABI_FIELD(LayerWeights, o_bias),
    ABI_FIELD(LayerWeights, gate_up), ABI_FIELD(LayerWeights, down), ABI_FIELD(LayerWeights, mlp_width),
    ABI_FIELD(LayerWeights, experts), ABI_FIELD(LayerWeights, no_rope), ABI_FIELD(LayerWeights, sinks),

    ABI_SIZE(LayerShape), ABI_FIELD(LayerShape, hidden), ABI_FIELD(LayerShape, num_heads),
    ABI_FIELD(LayerShape, num_kv_heads), ABI_FIELD(LayerShape, head_dim), ABI_FIELD(LayerShape, block_size),
    ABI_FIELD(LayerShape, eps), ABI_FIELD(LayerShape, scale), ABI_FIELD(LayerShape, num_threads),
    ABI_FIELD(LayerShape, cache_type), ABI_FIELD(LayerShape, linear_impl),

    ABI_SIZE(StepInputs), ABI_FIELD(StepInputs, m), ABI_FIELD(StepInputs, positions), ABI_FIELD(StepInputs, slots),
    ABI_FIELD(StepInputs, block_tables), ABI_FIELD(StepInputs, table_stride), ABI_FIELD(StepInputs, rows),
    ABI_FIELD(StepInputs, reqs), ABI_FIELD(StepInputs, seq_lens), ABI_FIELD(StepInputs, max_seq_len),
    ABI_FIELD(StepInputs, cos_table), ABI_FIELD(StepInputs, sin_table), ABI_FIELD(StepInputs, key_starts),

    ABI_SIZE(Scratch), ABI_FIELD(Scratch, normed), ABI_FIELD(Scratch, qkv), ABI_FIELD(Scratch, query),
    ABI_FIELD(Scratch, attn), ABI_FIELD(Scratch, proj), ABI_FIELD(Scratch, gate_up), ABI_FIELD(Scratch, act),
    ABI_FIELD(Scratch, kv_row), ABI_FIELD(Scratch, attn_scratch), ABI_FIELD(Scratch, router_logits),
    ABI_FIELD(Scratch, offsets), ABI_FIELD(Scratch, choice_rows), ABI_FIELD(Scratch, choice_scales),
    ABI_FIELD(Scratch, gathered), ABI_FIELD(Scratch, expert_out), ABI_FIELD(Scratch, partials),
    ABI_FIELD(Scratch, mixer_conv), ABI_FIELD(Scratch, mixer_core),

    ABI_SIZE(LinearMixer), ABI_FIELD(LinearMixer, in_proj), ABI_FIELD(LinearMixer, out_proj),
    ABI_FIELD(LinearMixer, conv_weight), ABI_FIELD(LinearMixer, a_log), ABI_FIELD(LinearMixer, dt_bias),
    ABI_FIELD(LinearMixer, norm_weight), ABI_FIELD(LinearMixer, conv_states), ABI_FIELD(LinearMixer, states),
    ABI_FIELD(LinearMixer, key_heads), ABI_FIELD(LinearMixer, value_heads), ABI_FIELD(LinearMixer, key_dim),
    ABI_FIELD(LinearMixer, value_dim), ABI_FIELD(LinearMixer, kernel), ABI_FIELD(LinearMixer, tiled),

    ABI_SIZE(HybridLayer), ABI_FIELD(HybridLayer, layer), ABI_FIELD(HybridLayer, input_scale),
    ABI_FIELD(HybridLayer, post_scale), ABI_FIELD(HybridLayer, q_scale), ABI_FIELD(HybridLayer, k_scale),
    ABI_FIELD(HybridLayer, mixer), ABI_FIELD(HybridLayer, rotary_dim),

    {NULL, 0},
};

const AbiEntry *abi_entries(void) { return ABI_ENTRIES; }
