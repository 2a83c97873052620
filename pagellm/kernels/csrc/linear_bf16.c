/* Model stage, CPU: the bf16 linear layers' entry point, y = x W^T (+ b).
 *
 * The caller names the kernel (impl: the measured choice of kernels/linear_choice.py), or
 * leaves it to the number of rows: up to STREAMING_MAX_ROWS the step only reads W and
 * small_linear.c streams it once; above, gemm_bf16.c's register tiles reuse it.
 * linear_bf16_part is the choice inside a caller's parallel region; linear_weight opens the
 * region for any Weight (quant_linear.c's linear_weight_part picks bf16 or quantized
 * kernels per part), and linear_bf16 is that for one bf16 matrix (kernels/linear.py).
 *
 * Built by pagellm/kernels/build.py; the bf16 path exists only where the compiler
 * targets AVX-512 BF16 (linear_bf16_supported).
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "float_mode.h"
#include "kernels.h"

#if defined(__AVX512BF16__) || defined(PAGELLM_FLOAT32_LINEARS)
int linear_bf16_supported(void) { return 1; }
#else
int linear_bf16_supported(void) { return 0; }
#endif

void linear_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                      void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int impl,
                      int t, int nt) {
    if (impl == LINEAR_STREAMING || (impl == LINEAR_BY_ROWS && m <= STREAMING_MAX_ROWS))
        small_linear_bf16_part(x, x_stride, w, bias, out, out_stride, out_f32, m, n, k, t, nt);
    else if (impl != LINEAR_AMX || !gemm_amx_part(x, x_stride, w, bias, out, out_stride, out_f32, m, n, k, t, nt))
        gemm_bf16_part(x, x_stride, w, bias, out, out_stride, out_f32, m, n, k, t, nt);
}

/* out = x W^T (+ bias) for any Weight (bf16 or quantized parts, quant_linear.c), opening the
 * parallel region (model/linear.py, kernels/weights.py); out is bf16 or float32 (out_f32),
 * impl one of LINEAR_* (kernels.h). */
void linear_weight(const uint16_t *x, int64_t x_stride, const Weight *w, const uint16_t *bias, void *out,
                   int64_t out_stride, int out_f32, int64_t m, int64_t k, int impl, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const unsigned float_mode = subnormals_flushed();
        linear_weight_part(x, x_stride, w, bias, out, out_stride, out_f32, m, k, impl, t, nt);
        float_mode_restore(float_mode);
    }
}

/* x: [m, k] bf16 (row stride x_stride, elements), w: [n, k] bf16 contiguous, bias: [n]
 * bf16 or NULL, out: [m, n] bf16 or float32 (row stride out_stride), m >= 1: a one-part Weight. */
void linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                 void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int impl,
                 int num_threads) {
    const Weight weight = {1, {{WEIGHT_BF16, n, 2 * k, (const uint8_t *)w, NULL}}};
    linear_weight(x, x_stride, &weight, bias, out, out_stride, out_f32, m, k, impl, num_threads);
}
