/* Model stage, CPU: the bf16 linear layers' choice of kernel, y = x W^T (+ b).
 *
 * The caller names the kernel (impl: the measured choice of kernels/linear_choice.py), or
 * leaves it to the number of rows: up to STREAMING_MAX_ROWS the step only reads W and
 * small_linear.c streams it once; above, gemm_bf16.c's register tiles reuse it.
 * linear_bf16_part is that choice inside a caller's parallel region: quant_linear.c's
 * linear_weight_part calls it for a Weight's bf16 parts, and linear.c's entry points open
 * the region.
 *
 * Built by pagellm/kernels/build.py.
 */
#include <stdint.h>

#include "kernels.h"

void linear_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                      void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int impl,
                      int t, int nt) {
    if (impl_streams(impl) || (impl == LINEAR_BY_ROWS && m <= STREAMING_MAX_ROWS))
        small_linear_bf16_part(x, x_stride, w, bias, out, out_stride, out_f32, m, n, k, t, nt);
    else if (impl != LINEAR_AMX || !gemm_amx_part(x, x_stride, w, bias, out, out_stride, out_f32, m, n, k, t, nt))
        gemm_bf16_part(x, x_stride, w, bias, out, out_stride, out_f32, m, n, k, t, nt);
}
