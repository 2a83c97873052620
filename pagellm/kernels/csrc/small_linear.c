/* Model stage, CPU: y = x W^T (+ b) for a few rows of x, streaming W once.
 *
 * At decode time a linear layer multiplies 1 to 8 activation rows by a weight matrix of
 * millions of elements: the time is the time to read W from memory. A general GEMM
 * library tiles for reuse that is not there at this size and reaches about half the
 * machine's read bandwidth here; this loop reads each weight row once, front to back,
 * and multiplies it into every activation row while it is in registers. Output rows are
 * split over the threads in contiguous ranges, so each thread streams its own part of W.
 *
 * bfloat16: AVX-512 BF16 dot products (pairs of bf16 products summed into float32
 * lanes), float32 accumulation, one rounding to bf16 at the end (none for a float32 output).
 * Weight rows are handled several at a time so independent accumulation chains run:
 * four for a single activation row (measured: ~46 GB/s against ~39 with two), two for
 * more, where the activation rows already give each step enough chains (four measured
 * slower there).
 *
 * Called through linear_bf16.c. Built at run time by pagellm/kernels/build.py with the
 * machine's C compiler; the bf16 path exists only where the compiler targets AVX-512 BF16.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"

#define MAX_ROWS 8
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

#if defined(__AVX512BF16__)
/* out[m, n] for rows n0 and n1 (n1 may equal n0 when only one is left), m <= MAX_ROWS. */
#define BF16_ROWS(M)                                                                         \
static void bf16_rows_##M(const uint16_t *x, int64_t x_stride, const uint16_t *w0,           \
                          const uint16_t *w1, int64_t k, float *sum0, float *sum1) {         \
    __m512 acc0[M], acc1[M];                                                                 \
    for (int m = 0; m < M; m++) { acc0[m] = _mm512_setzero_ps(); acc1[m] = _mm512_setzero_ps(); } \
    int64_t i = 0;                                                                           \
    for (; i + 32 <= k; i += 32) {                                                           \
        _mm_prefetch((const char *)(w0 + i) + PREFETCH_BYTES, _MM_HINT_T0);                 \
        _mm_prefetch((const char *)(w1 + i) + PREFETCH_BYTES, _MM_HINT_T0);                 \
        __m512bh a = (__m512bh)_mm512_loadu_si512((const void *)(w0 + i));                  \
        __m512bh b = (__m512bh)_mm512_loadu_si512((const void *)(w1 + i));                  \
        for (int m = 0; m < M; m++) {                                                        \
            __m512bh xm = (__m512bh)_mm512_loadu_si512((const void *)(x + m * x_stride + i)); \
            acc0[m] = _mm512_dpbf16_ps(acc0[m], xm, a);                                      \
            acc1[m] = _mm512_dpbf16_ps(acc1[m], xm, b);                                      \
        }                                                                                    \
    }                                                                                        \
    if (i < k) {                                                                             \
        __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);                                 \
        __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + i);                     \
        __m512bh b = (__m512bh)_mm512_maskz_loadu_epi16(mask, w1 + i);                     \
        for (int m = 0; m < M; m++) {                                                        \
            __m512bh xm = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + i);    \
            acc0[m] = _mm512_dpbf16_ps(acc0[m], xm, a);                                      \
            acc1[m] = _mm512_dpbf16_ps(acc1[m], xm, b);                                      \
        }                                                                                    \
    }                                                                                        \
    for (int m = 0; m < M; m++) {                                                            \
        sum0[m] = _mm512_reduce_add_ps(acc0[m]);                                             \
        sum1[m] = _mm512_reduce_add_ps(acc1[m]);                                             \
    }                                                                                        \
}
BF16_ROWS(1) BF16_ROWS(2) BF16_ROWS(3) BF16_ROWS(4) BF16_ROWS(5) BF16_ROWS(6) BF16_ROWS(7) BF16_ROWS(8)

typedef void (*bf16_rows_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, int64_t,
                             float *, float *);
static const bf16_rows_fn BF16_KERNELS[MAX_ROWS + 1] = {
    0, bf16_rows_1, bf16_rows_2, bf16_rows_3, bf16_rows_4, bf16_rows_5, bf16_rows_6, bf16_rows_7, bf16_rows_8,
};

/* One activation row against the four consecutive weight rows w .. w + 3k: four
 * independent accumulation chains keep more weight loads in flight than a pair does. */
static void bf16_one_row_quad(const uint16_t *x, const uint16_t *w, int64_t k, float sums[4]) {
    __m512 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        _mm_prefetch((const char *)(w + i) + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 2 * k + i) + PREFETCH_BYTES, _MM_HINT_T0);
        __m512bh xm = (__m512bh)_mm512_loadu_si512((const void *)(x + i));
        for (int r = 0; r < 4; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], xm, (__m512bh)_mm512_loadu_si512((const void *)(w + r * k + i)));
    }
    if (i < k) {
        __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);
        __m512bh xm = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i);
        for (int r = 0; r < 4; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], xm, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + i));
    }
    for (int r = 0; r < 4; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

/* Thread t of nt's share of the output columns (called by every thread of a region). */
void small_linear_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                            void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t,
                            int nt) {
    int64_t begin, end;
    thread_share(n, 2, t, nt, &begin, &end);
    if (m == 1) {
        float sums[4];
        for (; begin + 4 <= end; begin += 4) {
            bf16_one_row_quad(x, w + begin * k, k, sums);
            for (int r = 0; r < 4; r++)
                store_float(out, begin + r, sums[r] + (bias ? bf16_to_float(bias[begin + r]) : 0.0f), out_f32);
        }
    }
    float sum0[MAX_ROWS], sum1[MAX_ROWS];
    for (int64_t j = begin; j < end; j += 2) {
        int64_t j1 = j + 1 < end ? j + 1 : j;
        float b0 = bias ? bf16_to_float(bias[j]) : 0.0f;
        float b1 = bias ? bf16_to_float(bias[j1]) : 0.0f;
        for (int64_t first = 0; first < m; first += MAX_ROWS) {
            int64_t rows = m - first < MAX_ROWS ? m - first : MAX_ROWS;
            BF16_KERNELS[rows](x + first * x_stride, x_stride, w + j * k, w + j1 * k, k, sum0, sum1);
            for (int64_t r = 0; r < rows; r++) {
                void *row = out_at(out, (first + r) * out_stride, out_f32);
                store_float(row, j, sum0[r] + b0, out_f32);
                if (j1 != j) store_float(row, j1, sum1[r] + b1, out_f32);
            }
        }
    }
}
#else
void small_linear_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                            void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t,
                            int nt) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)out_stride; (void)out_f32;
    (void)m; (void)n; (void)k; (void)t; (void)nt;
}
#endif
