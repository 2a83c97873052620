/* Model stage, CPU: one mixture-of-experts layer's experts in one call.
 *
 * The step's rows are grouped by expert (the caller sorts the routing choices, or
 * route_rows below does): each expert that received rows gathers them, runs its gated MLP
 * (gate_up, silu(gate) * up, down) over all of them through linear_weight_part, and adds
 * its output, scaled by each row's routing weight, to those rows. Experts are added in
 * ascending order, so float32 sums round as the per-expert loop in
 * model/mixture_of_experts.py does. In Python that loop cost about ten small torch
 * operations and two kernel calls per chosen expert; here the whole layer is one parallel
 * region, with barriers between the stages. The one-call decode layer (decode_layer.c)
 * runs the same stages inside its own region, after routing its rows in C.
 *
 * Precision as layer_rows.h: the rows and the activation are bf16 (what a matmul reads), the
 * linear outputs and the accumulated output float32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "float_mode.h"
#include "kernels.h"
#include "layer_rows.h"

/* Whether the experts that received rows are shared among the threads whole rather than
 * each expert's rows of W split among all of them: one long stream of weights per thread and
 * one barrier for the layer, instead of three barriers per expert between short streams.
 * Measured on a Qwen3-MoE shape as Q4_0 (4 of 32 experts, hidden 1024, 2 threads, Zen 4,
 * interleaved A/B in one process): the one-call layers of a single-stream decode step 2.50
 * against 2.72 ms; 32 requests 516 against 481 tok/s. Worth it when the experts divide
 * nearly evenly: at a few rows an expert costs the reading of its weights, whatever its row
 * count. */
/* bf16 of an expert's activation of one element (ExpertForm: gpt-oss's clamped SwiGLU). */
static inline uint16_t expert_activation(const ExpertForm *form, float gate, float up) {
    if (form == NULL || form->swiglu_limit <= 0.0f) return silu_mul(gate, up);
    const float limit = form->swiglu_limit;
    const float g = gate < limit ? gate : limit;
    const float u = up < -limit ? -limit : (up > limit ? limit : up);
    return float_to_bf16((u + 1.0f) * (g / (1.0f + expf(-form->swiglu_alpha * g))));
}

static inline const uint16_t *expert_bias(const uint16_t *const *biases, int64_t expert) {
    return biases == NULL ? NULL : biases[expert];
}

static int experts_per_thread(const int64_t *offsets, int64_t num_experts, int64_t m, int nt) {
    if (nt < 2 || m > EXPERTS_PER_THREAD_MAX_ROWS) return 0;
    int64_t active = 0;
    for (int64_t e = 0; e < num_experts; e++) active += offsets[e + 1] > offsets[e];
    const int64_t most = (active + nt - 1) / nt; /* experts of the busiest thread */
    return active >= nt && 4 * most * nt <= 5 * active;
}

/* The experts of thread t (every nt-th expert that received rows, ascending) summed into
 * its own partial output [m, hidden]; the caller adds the threads' partials. */
static void own_experts(const uint16_t *x, int64_t m, int64_t hidden, int64_t inter, int64_t num_experts,
                        const Weight *const *gate_up, const Weight *const *down, const int64_t *offsets,
                        const int64_t *rows, const float *scales, const int32_t *impls, const ExpertForm *form,
                        float *partial, int t, int nt) {
    const uint16_t *const *gate_up_bias = form ? form->gate_up_bias : NULL, *const *down_bias = form ? form->down_bias : NULL;
    static _Thread_local void *buffer;
    static _Thread_local size_t capacity;
    memset(partial, 0, sizeof(float) * (size_t)(m * hidden));
    int64_t active = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t first = offsets[e], count = offsets[e + 1] - offsets[e];
        if (count == 0 || active++ % nt != t) continue;
        const size_t bytes = (size_t)count * (size_t)(2 * hidden + 8 * inter + 2 * inter + 4 * hidden);
        uint16_t *gathered = grow_buffer(&buffer, &capacity, bytes);
        float *gate_up_out = (float *)(gathered + count * hidden);
        uint16_t *act = (uint16_t *)(gate_up_out + count * 2 * inter);
        float *expert_out = (float *)(act + count * inter);
        for (int64_t i = 0; i < count; i++)
            memcpy(gathered + i * hidden, x + rows[first + i] * hidden, sizeof(uint16_t) * (size_t)hidden);
        linear_weight_part(gathered, hidden, gate_up[e], expert_bias(gate_up_bias, e), gate_up_out, 2 * inter, 1, count,
                           hidden, impls[2 * count], 0, 1);
        for (int64_t i = 0; i < count; i++) {
            const float *gate = gate_up_out + i * 2 * inter, *up = gate + inter;
            for (int64_t j = 0; j < inter; j++) act[i * inter + j] = expert_activation(form, gate[j], up[j]);
        }
        linear_weight_part(act, inter, down[e], expert_bias(down_bias, e), expert_out, hidden, 1, count, inter,
                           impls[2 * count + 1], 0, 1);
        for (int64_t i = 0; i < count; i++) {
            float *dst = partial + rows[first + i] * hidden;
            const float *src = expert_out + i * hidden;
            const float scale = scales[first + i];
            for (int64_t j = 0; j < hidden; j++) dst[j] += scale * src[j];
        }
    }
}

void moe_experts_in_region(const uint16_t *x, int64_t m, int64_t hidden, int64_t inter, int64_t num_experts,
                           const Weight *const *gate_up, const Weight *const *down, const int64_t *offsets,
                           const int64_t *rows, const float *scales, const int32_t *impls, float *out,
                           const MoeScratch *scratch, const ExpertForm *form, int t, int nt) {
    const uint16_t *const *gate_up_bias = form ? form->gate_up_bias : NULL, *const *down_bias = form ? form->down_bias : NULL;
    if (scratch->partials != NULL && experts_per_thread(offsets, num_experts, m, nt)) {
        own_experts(x, m, hidden, inter, num_experts, gate_up, down, offsets, rows, scales, impls, form,
                    scratch->partials + t * m * hidden, t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m * hidden; i++) {
            float sum = 0.0f;
            for (int u = 0; u < nt; u++) sum += scratch->partials[u * m * hidden + i];
            out[i] = sum;
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) memset(out + r * hidden, 0, sizeof(float) * (size_t)hidden);
    for (int64_t e = 0; e < num_experts; e++) {
        const int64_t first = offsets[e], count = offsets[e + 1] - offsets[e];
        if (count == 0) continue; /* the same for every thread: no barrier is skipped unevenly */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++)
            memcpy(scratch->gathered + i * hidden, x + rows[first + i] * hidden, sizeof(uint16_t) * (size_t)hidden);
        linear_weight_part(scratch->gathered, hidden, gate_up[e], expert_bias(gate_up_bias, e), scratch->gate_up,
                           2 * inter, 1, count, hidden, impls[2 * count], t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const float *gate = scratch->gate_up + i * 2 * inter, *up = gate + inter;
            uint16_t *dst = scratch->act + i * inter;
            for (int64_t j = 0; j < inter; j++) dst[j] = expert_activation(form, gate[j], up[j]);
        }
        linear_weight_part(scratch->act, inter, down[e], expert_bias(down_bias, e), scratch->expert_out, hidden, 1, count,
                           inter, impls[2 * count + 1], t, nt);
#pragma omp barrier
        /* A row takes each expert once: the rows of one expert are distinct. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            float *dst = out + rows[first + i] * hidden;
            const float *src = scratch->expert_out + i * hidden;
            const float scale = scales[first + i];
            for (int64_t j = 0; j < hidden; j++) dst[j] += scale * src[j];
        }
    }
}

/* One thread: each row's top_k experts from its router logits ([m, num_experts] float32),
 * as model/mixture_of_experts.py route(): softmax over all experts, the top_k largest
 * probabilities (an exact tie goes to the lower expert: torch.topk leaves that order
 * unspecified), divided by their sum where renormalize;
 * then the choices grouped by expert in ascending order, rows ascending within an expert:
 * offsets [num_experts + 1], rows and scales [m * top_k]. */
void route_rows(const float *logits, int64_t m, int64_t num_experts, int top_k, int renormalize, int64_t *offsets,
                int64_t *rows, float *scales) {
    int64_t chosen[m * top_k];
    float weights[m * top_k];
    for (int64_t r = 0; r < m; r++) {
        const float *row = logits + r * num_experts;
        float most = row[0];
        for (int64_t e = 1; e < num_experts; e++) most = row[e] > most ? row[e] : most;
        float sum = 0.0f;
        for (int64_t e = 0; e < num_experts; e++) sum += expf(row[e] - most);
        int64_t *mine = chosen + r * top_k;
        float *weight = weights + r * top_k, total = 0.0f;
        for (int j = 0; j < top_k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < num_experts; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= mine[i] == e;
                if (!taken && (best < 0 || row[e] > row[best])) best = e;
            }
            mine[j] = best;
            weight[j] = expf(row[best] - most) / sum;
            total += weight[j];
        }
        if (renormalize)
            for (int j = 0; j < top_k; j++) weight[j] /= total;
    }
    int64_t next = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        offsets[e] = next;
        for (int64_t i = 0; i < m * top_k; i++)
            if (chosen[i] == e) {
                rows[next] = i / top_k;
                scales[next++] = weights[i];
            }
    }
    offsets[num_experts] = next;
}

/*
 * x:          [m, hidden] bf16, the normed rows (row stride hidden)
 * gate_up:    [num_experts] Weight* of [2 * inter, hidden]; down: [num_experts] Weight* of [hidden, inter]
 * offsets:    [num_experts + 1]: expert e's choices are order[offsets[e] .. offsets[e + 1])
 * rows:       [choices] the row of each choice, grouped by expert
 * scales:     [choices] its routing weight
 * impls:      [(most rows of an expert + 1) * 2] the linear kernel of gate_up and down at each row count
 * out:        [m, hidden] float32, zeroed here, then the weighted sum of the experts' outputs
 * scratch:    gathered rows [max_rows, hidden] bf16, gate_up [max_rows, 2 * inter] float32,
 *             act [max_rows, inter] bf16, expert output [max_rows, hidden] float32, and
 *             partials [num_threads, m, hidden] float32 or NULL (experts_per_thread)
 * gate_up_bias, down_bias, swiglu_limit, swiglu_alpha: the experts' form (kernels.h ExpertForm;
 *             NULL, NULL, 0: Llama's gated MLP)
 */
void moe_experts_bf16(const uint16_t *x, int64_t m, int64_t hidden, int64_t inter, int64_t num_experts,
                      const Weight *const *gate_up, const Weight *const *down, const int64_t *offsets,
                      const int64_t *rows, const float *scales, const int32_t *impls, float *out,
                      uint16_t *gathered, float *gate_up_out, uint16_t *act, float *expert_out, float *partials,
                      const uint16_t *const *gate_up_bias, const uint16_t *const *down_bias, float swiglu_limit,
                      float swiglu_alpha, int num_threads) {
    const MoeScratch scratch = {gathered, gate_up_out, act, expert_out, partials};
    const ExpertForm form = {gate_up_bias, down_bias, swiglu_limit, swiglu_alpha};
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        moe_experts_in_region(x, m, hidden, inter, num_experts, gate_up, down, offsets, rows, scales, impls, out,
                              &scratch, &form, t, nt);
        float_mode_restore(float_mode);
    }
}
