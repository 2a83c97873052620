/* Model stage, CPU: one mixture-of-experts layer's experts in one call.
 *
 * The step's rows are grouped by expert (the caller sorts the routing choices): each expert
 * that received rows gathers them, runs its gated MLP (gate_up, silu(gate) * up, down) over
 * all of them through linear_weight_part, and adds its output, scaled by each row's routing
 * weight, to those rows. Experts are added in ascending order (the caller's), so float32 sums
 * round as the per-expert loop in model/mixture_of_experts.py does. In Python that loop cost
 * about ten small torch operations and two kernel calls per chosen expert; here the whole
 * layer is one parallel region, with barriers between the stages.
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

/*
 * x:          [m, hidden] bf16, the normed rows (row stride hidden)
 * gate_up:    [num_experts] Weight* of [2 * inter, hidden]; down: [num_experts] Weight* of [hidden, inter]
 * offsets:    [num_experts + 1]: expert e's choices are order[offsets[e] .. offsets[e + 1])
 * rows:       [choices] the row of each choice, grouped by expert
 * scales:     [choices] its routing weight
 * impls:      [num_experts * 2] the linear kernel of gate_up and down at that expert's row count
 * out:        [m, hidden] float32, zeroed here, then the weighted sum of the experts' outputs
 * scratch:    gathered rows [max_rows, hidden] bf16, gate_up [max_rows, 2 * inter] float32,
 *             act [max_rows, inter] bf16, expert output [max_rows, hidden] float32
 */
void moe_experts_bf16(const uint16_t *x, int64_t m, int64_t hidden, int64_t inter, int64_t num_experts,
                      const Weight *const *gate_up, const Weight *const *down, const int64_t *offsets,
                      const int64_t *rows, const float *scales, const int32_t *impls, float *out,
                      uint16_t *gathered, float *gate_up_out, uint16_t *act, float *expert_out, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) memset(out + r * hidden, 0, sizeof(float) * (size_t)hidden);
        for (int64_t e = 0; e < num_experts; e++) {
            const int64_t first = offsets[e], count = offsets[e + 1] - offsets[e];
            if (count == 0) continue;  /* the same for every thread: no barrier is skipped unevenly */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < count; i++)
                memcpy(gathered + i * hidden, x + rows[first + i] * hidden, sizeof(uint16_t) * (size_t)hidden);
            linear_weight_part(gathered, hidden, gate_up[e], NULL, gate_up_out, 2 * inter, 1, count, hidden,
                               impls[2 * e], t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t i = 0; i < count; i++) {
                const float *gate = gate_up_out + i * 2 * inter, *up = gate + inter;
                uint16_t *dst = act + i * inter;
                for (int64_t j = 0; j < inter; j++) dst[j] = silu_mul(gate[j], up[j]);
            }
            linear_weight_part(act, inter, down[e], NULL, expert_out, hidden, 1, count, inter, impls[2 * e + 1], t, nt);
#pragma omp barrier
            /* A row takes each expert once: the rows of one expert are distinct. */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < count; i++) {
                float *dst = out + rows[first + i] * hidden;
                const float *src = expert_out + i * hidden;
                const float scale = scales[first + i];
                for (int64_t j = 0; j < hidden; j++) dst[j] += scale * src[j];
            }
        }
        float_mode_restore(float_mode);
    }
}
