/* Model stage, CPU: the linear layers' entry points, y = x W^T (+ b), each opening the
 * parallel region (kernels/linear_bindings.py, kernels/weights.py).
 *
 * linear_weight takes any Weight through linear_weight_part: quant_linear.c's runs bf16
 * parts through linear_bf16.c and quantized ones through its own kernels (linear_f32.c's,
 * in the float32 builds, computes every part in float32); linear_bf16 is the same for one
 * bf16 matrix. The entry points live here, above both, so that quant_linear.c calls into
 * linear_bf16.c and nothing calls back.
 *
 * Built by pagellm/kernels/build.py; linear_bf16_supported says whether this build has
 * the bf16 path (AVX-512 BF16 dot products, or linear_f32.c's float32 arithmetic).
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

/* out = x W^T (+ bias) for any Weight (bf16 or quantized parts, quant_linear.c), opening the
 * parallel region (model/packable_layers.py, kernels/weights.py); out is bf16 or float32 (out_f32),
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
