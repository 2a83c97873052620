/* Model stage, CPU: y = x W^T (+ b) in bfloat16 for tens to thousands of rows of x.
 *
 * Above the decode steps that only stream W (small_linear.c, up to 16 rows), PyTorch's
 * bf16 GEMM reaches 400-650 GFLOP/s on this machine's two cores at 32-64 rows (the decode
 * steps of a busy server), against about 1100 for the dot-product instruction itself.
 * This kernel gets 600-850 there, and about PyTorch's ~930 from 512 rows on:
 *
 *  - AVX-512 BF16 `vdpbf16ps` takes, in each of its 16 float32 lanes, the dot product of
 *    one pair of bf16 values of x with one pair of W. So W is repacked, a panel of 64
 *    output columns at a time, into pairs: panel[p][c] = (W[c][2p], W[c][2p+1]), 16
 *    columns per vector. The repacking is a 16 x 16 transpose of 32-bit pairs in
 *    registers (64 shuffles per 16 vectors), done once per panel per block of rows and
 *    kept in L2 while every row tile of the block passes over it.
 *  - A tile of 6 rows x 64 columns lives in 24 accumulator registers for the whole K
 *    loop: per pair of K, 4 panel loads and 6 broadcasts of x feed 24 dot products.
 *  - While the tiles compute, they read the next panel's rows of W into L2, so that
 *    repacking it does not wait on memory.
 *  - Threads split the output columns (16 at a time), so each reads its own part of W.
 *
 * float32 accumulation, one rounding to bf16 at the end (round to nearest even, as torch;
 * the conversion instruction reads subnormal sums as zero, as the kernels' FTZ/DAZ mode
 * does anyway).
 * Called through linear_bf16.c. Built by pagellm/kernels/build.py; the bf16 path
 * exists only where the compiler targets AVX-512 BF16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>

#include "kernels.h"

#define TILE_ROWS 6       /* rows of x per register tile */
#define PANEL_VECTORS 4   /* 16-column vectors per panel */
#define BLOCK_ROWS 192    /* rows of x per block (their x stays in L2 across panels) */

#if defined(__AVX512BF16__)
/* The packed panel of this thread, grown as needed and kept for the thread's lifetime
 * (OpenMP reuses its threads, so steady state allocates nothing). */
static _Thread_local uint32_t *panel_buffer;
static _Thread_local size_t panel_capacity;

static uint32_t *panel_storage(size_t elements) {
    if (elements > panel_capacity) {
        free(panel_buffer);
        panel_buffer = aligned_alloc(64, ((elements * sizeof(uint32_t) + 63) / 64) * 64);
        panel_capacity = panel_buffer ? elements : 0;
    }
    return panel_buffer;
}

/* Transpose 16 vectors of 16 32-bit elements: out[i] lane l = in[l] lane i. */
static inline void transpose_16x16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int j = 0; j < 8; j++) {
        a[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
        a[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
    }
    /* b[4j + c], 128-bit lane q: column 4q + c of rows 4j .. 4j + 3 */
    for (int j = 0; j < 4; j++) {
        b[4 * j + 0] = _mm512_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
        b[4 * j + 1] = _mm512_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
        b[4 * j + 2] = _mm512_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
        b[4 * j + 3] = _mm512_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
    }
    /* out[4q + c] gathers lane q of b[c], b[4 + c], b[8 + c], b[12 + c] */
    for (int c = 0; c < 4; c++) {
        const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
        const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
        r[0 + c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
}

/* Pack columns [col, col + 16 * vectors) of W (rows of W beyond n read as zero) into
 * panel[p * vectors * 16 + v * 16 + l] = pair p of W row col + 16 v + l. An odd k's last
 * pair has a zero second half. */
void pack_panel(const uint16_t *w, int64_t n, int64_t k, int64_t col, int vectors, uint32_t *panel) {
    const int64_t pairs = (k + 1) / 2;
    for (int v = 0; v < vectors; v++) {
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
            const int64_t left = k - 2 * p0;
            const __mmask32 mask = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
            __m512i r[16];
            for (int l = 0; l < 16; l++) {
                const int64_t row = col + 16 * v + l;
                r[l] = row < n ? _mm512_maskz_loadu_epi16(mask, w + row * k + 2 * p0) : _mm512_setzero_si512();
            }
            transpose_16x16(r);
            const int64_t count = pairs - p0 < 16 ? pairs - p0 : 16;
            for (int64_t i = 0; i < count; i++)
                _mm512_store_si512((void *)(panel + ((p0 + i) * vectors + v) * 16), r[i]);
        }
    }
}

/* The pair p of row x as a 32-bit value broadcast to every lane (k odd: last pair's
 * second half zero, never read past the row). */
static inline __m512bh pair_of(const uint16_t *x, int64_t p, int64_t full_pairs) {
    if (p < full_pairs) return (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + 2 * p));
    return (__m512bh)_mm512_set1_epi32((int32_t)x[2 * p]);
}

/* out rows [0, ROWS) x columns [0, 16 VECTORS) (the last `width` of them stored) of one
 * tile; ROWS and VECTORS are constants in every instantiation, so acc stays in registers. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, int64_t x_stride, const uint32_t *panel, int64_t k, const uint16_t *bias,
    void *out, int64_t out_stride, int out_f32, int64_t width, const char *prefetch, int64_t prefetch_lines,
    const int ROWS, const int VECTORS) {
    const int64_t pairs = (k + 1) / 2, full_pairs = k / 2;
    __m512 acc[TILE_ROWS][PANEL_VECTORS];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < VECTORS; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *packed = panel + p * VECTORS * 16;
        if (p < prefetch_lines) _mm_prefetch(prefetch + 64 * p, _MM_HINT_T1);
        __m512bh b[PANEL_VECTORS];
        for (int v = 0; v < VECTORS; v++) b[v] = (__m512bh)_mm512_load_si512((const void *)(packed + 16 * v));
        for (int r = 0; r < ROWS; r++) {
            const __m512bh a = pair_of(x + r * x_stride, p, full_pairs);
            for (int v = 0; v < VECTORS; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
        }
    }
    for (int v = 0; v < VECTORS; v++) {
        const int64_t left = width - 16 * v;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 add = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + 16 * v)), 16))
                                : _mm512_setzero_ps();
        for (int r = 0; r < ROWS; r++) {
            const __m512 value = _mm512_add_ps(acc[r][v], add);
            if (out_f32)
                _mm512_mask_storeu_ps((float *)out + r * out_stride + 16 * v, mask, value);
            else
                _mm256_mask_storeu_epi16((uint16_t *)out + r * out_stride + 16 * v, mask,
                                         (__m256i)_mm512_cvtneps_pbh(value));
        }
    }
}

#define TILE_CASE(R, V) \
    case R: tile(x, x_stride, panel, k, bias, out, out_stride, out_f32, width, prefetch, prefetch_lines, R, V); break;
#define TILE_SWITCH(V)                                                                       \
    static void tile_##V(const uint16_t *x, int64_t x_stride, const uint32_t *panel, int64_t k, \
                         const uint16_t *bias, void *out, int64_t out_stride, int out_f32, int64_t width, \
                         const char *prefetch, int64_t prefetch_lines, int rows) {                  \
        switch (rows) { TILE_CASE(1, V) TILE_CASE(2, V) TILE_CASE(3, V) TILE_CASE(4, V) TILE_CASE(5, V) TILE_CASE(6, V) } \
    }
TILE_SWITCH(1) TILE_SWITCH(2) TILE_SWITCH(3) TILE_SWITCH(4)

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint32_t *, int64_t, const uint16_t *, void *,
                        int64_t, int, int64_t, const char *, int64_t, int);
static const tile_fn TILES[PANEL_VECTORS + 1] = {0, tile_1, tile_2, tile_3, tile_4};

/* Thread t of nt's share of out = x w^T (+ bias), inside a parallel region: the output
 * columns in 16-column groups, all rows. */
void gemm_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                    void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t, int nt) {
    const int64_t groups = (n + 15) / 16;
    const int64_t per = groups / nt, extra = groups % nt;
    const int64_t first = t * per + (t < extra ? t : extra);
    const int64_t count = per + (t < extra ? 1 : 0);
    if (count == 0) return;
    const int64_t pairs = (k + 1) / 2;
    uint32_t *panel = panel_storage((size_t)pairs * PANEL_VECTORS * 16);
    if (!panel) {
        /* No memory for a panel (a few hundred KB): this thread's columns stream W instead. */
        const int64_t col = 16 * first, width = 16 * (first + count) < n ? 16 * count : n - col;
        small_linear_bf16_part(x, x_stride, w + col * k, bias ? bias + col : 0, out_at(out, col, out_f32), out_stride,
                               out_f32, m, width, k, 0, 1);
        return;
    }
    for (int64_t row0 = 0; row0 < m; row0 += BLOCK_ROWS) {
        const int64_t rows = m - row0 < BLOCK_ROWS ? m - row0 : BLOCK_ROWS;
        for (int64_t g = first; g < first + count; g += PANEL_VECTORS) {
            const int vectors = (int)(first + count - g < PANEL_VECTORS ? first + count - g : PANEL_VECTORS);
            const int64_t col = 16 * g;
            const int64_t width = n - col < 16 * vectors ? n - col : 16 * vectors;
            pack_panel(w, n, k, col, vectors, panel);
            /* The tiles bring the next panel's rows of W (contiguous) into L2 while they
             * compute, a line per pair of K, so that packing it does not wait on memory
             * (measured at 64 rows: 845 against 534 GFLOP/s for gate_up without). */
            const int64_t next = col + 16 * vectors;
            const int64_t next_end = 16 * (first + count) < n ? 16 * (first + count) : n;
            const int64_t next_rows = next_end - next < 16 * PANEL_VECTORS ? next_end - next : 16 * PANEL_VECTORS;
            const char *prefetch = (const char *)(w + next * k);
            int64_t prefetch_lines = next_rows > 0 ? (next_rows * k * 2 + 63) / 64 : 0;
            for (int64_t r = 0; r < rows; r += TILE_ROWS) {
                const int tile_rows = (int)(rows - r < TILE_ROWS ? rows - r : TILE_ROWS);
                const int64_t lines = prefetch_lines < pairs ? prefetch_lines : pairs;
                TILES[vectors](x + (row0 + r) * x_stride, x_stride, panel, k, bias ? bias + col : 0,
                               out_at(out, (row0 + r) * out_stride + col, out_f32), out_stride, out_f32, width,
                               prefetch, lines, tile_rows);
                prefetch += 64 * lines;
                prefetch_lines -= lines;
            }
        }
    }
}
#else
void gemm_bf16_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                    void *out, int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t, int nt) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)out_stride; (void)out_f32;
    (void)m; (void)n; (void)k; (void)t; (void)nt;
}
#endif
