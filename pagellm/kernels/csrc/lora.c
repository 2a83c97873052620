/* Kernels, CPU: the LoRA adapters' products of one linear layer, for every adapter of a
 * step in one call (lora/slots.py LoRASlots).
 *
 * A step's rows are grouped by adapter (one range each); for every range, with the
 * adapter's slot s,
 *     out[rows] += (x[rows] A_s^T) B_s
 * where A_s [ranks, in] holds the scaling already and B_s [ranks, out] is the expand
 * matrix transposed, both float32 or both bf16 (w_bf16: a bf16 model's slots, half the
 * bytes to read; the products are computed in float32 either way). A fused layer's adapter is block-diagonal (q's ranks write only q's
 * columns): `pieces` names, per slot, up to MAX_PIECES (first rank, end rank, first
 * column, end column), so the zeros between the blocks are never multiplied.
 *
 * The work is small beside the base layer (ranks of 8-64 against thousands of features)
 * and bound by reading each adapter's A and B once per step, so the rows of a range are
 * taken up to WORK_ROWS at a time: each row of A or B read serves all of them. In torch the
 * same products cost two matmul calls per adapter and layer, whose fixed cost dominated a
 * step of many adapters (measured in docs/lora.md).
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <immintrin.h>

#include "bf16.h"
#include "float_mode.h"

#define MAX_PIECES 3
#define WORK_ROWS 8
#define MAX_RANKS 256

static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Element i of a row of weights, float32 or bf16. */
static inline float weight_at(const void *w, int64_t i, int w_bf16) {
    return w_bf16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

static inline __m256 weights8(const void *w, int64_t i, int w_bf16) {
    return w_bf16 ? widen8((const uint16_t *)w + i) : _mm256_loadu_ps((const float *)w + i);
}

/* The builds without AVX-512: dot(x, w) and y += s * w, eight at a time. */
static inline float dot8(const float *x, const void *w, int w_bf16, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), weights8(w, i, w_bf16), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float sum = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
    for (; i < n; i++) sum += x[i] * weight_at(w, i, w_bf16);
    return sum;
}

static inline void axpy8(float *y, float s, const void *w, int w_bf16, int64_t n) {
    const __m256 sv = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(sv, weights8(w, i, w_bf16), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += s * weight_at(w, i, w_bf16);
}

#if defined(__AVX512F__)
static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* shrunk[r * stride] = dot(x row r, a) for the count rows of x (float32 [count, in]): a
 * read once for all of them, two independent accumulators per row (one chain of fused
 * multiply-adds would wait on its latency at every step). */
static inline void dots(const float *x, int count, int64_t in, const void *a, int w_bf16, float *shrunk, int stride) {
#if defined(__AVX512F__)
    __m512 acc0[WORK_ROWS], acc1[WORK_ROWS];
    for (int r = 0; r < count; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= in; i += 32) {
        const __m512 a0 = w_bf16 ? widen16((const uint16_t *)a + i) : _mm512_loadu_ps((const float *)a + i);
        const __m512 a1 = w_bf16 ? widen16((const uint16_t *)a + i + 16) : _mm512_loadu_ps((const float *)a + i + 16);
        for (int r = 0; r < count; r++) {
            acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * in + i), a0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * in + i + 16), a1, acc1[r]);
        }
    }
    for (int r = 0; r < count; r++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
        for (int64_t j = i; j < in; j++) sum += x[r * in + j] * weight_at(a, j, w_bf16);
        shrunk[r * stride] = sum;
    }
#else
    for (int r = 0; r < count; r++) shrunk[r * stride] = dot8(x + r * in, a, w_bf16, in);
#endif
}

/* Rows [first, first + count) (count <= WORK_ROWS) of one range under slot `slot`. */
static void lora_rows(const void *x, int64_t x_stride, int x_f32, void *out, int64_t out_stride, int out_f32,
                      const void *a, const void *b, int w_bf16, const int64_t *pieces, int num_pieces, int64_t ranks,
                      int64_t in, int64_t n, int64_t first, int count, float *scratch) {
    float *xf = scratch;                          /* [count, in] */
    float *delta = xf + (int64_t)WORK_ROWS * in;  /* [count, n] */
    float shrunk[WORK_ROWS][MAX_RANKS];
    for (int r = 0; r < count; r++) {
        float *dst = xf + r * in;
        if (x_f32) {
            memcpy(dst, (const float *)x + (first + r) * x_stride, sizeof(float) * (size_t)in);
        } else {
            const uint16_t *src = (const uint16_t *)x + (first + r) * x_stride;
            for (int64_t k = 0; k < in; k++) dst[k] = bf16_to_float(src[k]);
        }
    }
    const int64_t a_row_bytes = in * (w_bf16 ? 2 : 4);
    for (int p = 0; p < num_pieces; p++) {
        const int64_t r0 = pieces[4 * p], r1 = pieces[4 * p + 1];
        for (int64_t q = r0; q < r1; q++) {
            if (q + 2 < r1) { /* two rows of A ahead, whole: the rows stream from memory */
                const char *ahead = (const char *)a + (q + 2) * a_row_bytes;
                for (int64_t offset = 0; offset < a_row_bytes; offset += 64) _mm_prefetch(ahead + offset, _MM_HINT_T0);
            }
            dots(xf, count, in, (const char *)a + q * in * (w_bf16 ? 2 : 4), w_bf16, &shrunk[0][q], MAX_RANKS);
        }
    }
    for (int r = 0; r < count; r++) memset(delta + r * n, 0, sizeof(float) * (size_t)n);
    for (int p = 0; p < num_pieces; p++) {
        const int64_t r0 = pieces[4 * p], r1 = pieces[4 * p + 1], c0 = pieces[4 * p + 2], c1 = pieces[4 * p + 3];
#if defined(__AVX512F__)
        /* 16 columns at a time, summed over the piece's ranks in registers (the pieces of one
         * adapter cover disjoint columns: each is stored once). */
        for (int64_t c = c0; c < c1; c += 16) {
            const __mmask16 mask = c1 - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (c1 - c)) - 1);
            __m512 acc[WORK_ROWS];
            for (int r = 0; r < count; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t q = r0; q < r1; q++) {
                _mm_prefetch((const char *)b + ((q * n + c) << (w_bf16 ? 1 : 2)) + 256, _MM_HINT_T0);
                const __m512 bv = w_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                               _mm256_maskz_loadu_epi16(mask, (const uint16_t *)b + q * n + c)), 16))
                                         : _mm512_maskz_loadu_ps(mask, (const float *)b + q * n + c);
                for (int r = 0; r < count; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(shrunk[r][q]), bv, acc[r]);
            }
            for (int r = 0; r < count; r++) _mm512_mask_storeu_ps(delta + r * n + c, mask, acc[r]);
        }
        continue;
#endif
        for (int64_t q = r0; q < r1; q++) {
            const void *b_row = (const char *)b + (q * n + c0) * (w_bf16 ? 2 : 4);
            for (int r = 0; r < count; r++) axpy8(delta + r * n + c0, shrunk[r][q], b_row, w_bf16, c1 - c0);
        }
    }
    for (int r = 0; r < count; r++) {
        const float *d = delta + r * n;
        if (out_f32) {
            float *o = (float *)out + (first + r) * out_stride;
            for (int64_t j = 0; j < n; j++) o[j] += d[j];
        } else { /* bf16: the sum rounded once */
            uint16_t *o = (uint16_t *)out + (first + r) * out_stride;
            for (int64_t j = 0; j < n; j++) o[j] = float_to_bf16(bf16_to_float(o[j]) + d[j]);
        }
    }
    (void)ranks;
}

/*
 * x:        [m, in] bf16 or float32 (x_f32), row stride x_stride (elements)
 * out:      [m, n] bf16 or float32 (out_f32), row stride out_stride; added to
 * a:        [slots, ranks, in] (scaling * A);  b: [slots, ranks, n] (B^T); float32, or bf16 (w_bf16)
 * ranges:   [num_ranges, 3]: slot, first row, end row
 * pieces:   [slots, MAX_PIECES, 4]: first rank, end rank, first column, end column
 * num_pieces: [slots] pieces in use per slot (0: the slot leaves this layer alone)
 * scratch:  [num_threads, WORK_ROWS * (in + n)] float32
 * Returns -1 when ranks exceed MAX_RANKS (the caller falls back to torch).
 */
int lora_add(const void *x, int64_t x_stride, int x_f32, void *out, int64_t out_stride, int out_f32, const void *a,
             const void *b, int w_bf16, int64_t ranks, int64_t in, int64_t n, const int64_t *ranges, int64_t num_ranges,
             const int64_t *pieces, const int32_t *num_pieces, float *scratch, int num_threads) {
    const int64_t element = w_bf16 ? 2 : 4;
    if (ranks > MAX_RANKS) return -1;
    /* Work items: (range, first row of a run of up to WORK_ROWS). */
    int64_t items = 0;
    for (int64_t i = 0; i < num_ranges; i++) items += (ranges[3 * i + 2] - ranges[3 * i + 1] + WORK_ROWS - 1) / WORK_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        const unsigned float_mode = subnormals_flushed();
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *mine = scratch + (int64_t)t * WORK_ROWS * (in + n);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t left = item, range = 0;
            for (; range < num_ranges; range++) {
                const int64_t runs = (ranges[3 * range + 2] - ranges[3 * range + 1] + WORK_ROWS - 1) / WORK_ROWS;
                if (left < runs) break;
                left -= runs;
            }
            const int64_t slot = ranges[3 * range], end = ranges[3 * range + 2];
            const int64_t first = ranges[3 * range + 1] + left * WORK_ROWS;
            const int count = (int)(end - first < WORK_ROWS ? end - first : WORK_ROWS);
            if (num_pieces[slot] == 0) continue;
            lora_rows(x, x_stride, x_f32, out, out_stride, out_f32, (const char *)a + slot * ranks * in * element,
                      (const char *)b + slot * ranks * n * element, w_bf16, pieces + slot * MAX_PIECES * 4,
                      num_pieces[slot], ranks, in, n, first, count, mine);
        }
        float_mode_restore(float_mode);
    }
    return 0;
}
