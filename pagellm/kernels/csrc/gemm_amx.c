/* Model stage, CPU: y = x W^T (+ b) in bfloat16 on AMX tiles, float32 or bf16 output.
 *
 * On CPUs with AMX-BF16 one `tdpbf16ps` multiplies a 16 x 32 bf16 tile of x by a 32 x 16
 * tile of W into a 16 x 16 float32 tile: 16 times the work of an AVX-512 dot product.
 * oneDNN (torch's F.linear) uses it too, but writes bf16 outputs and needs W whole in
 * bf16; this kernel writes float32 (the residual stream's precision) and takes the panels
 * gemm_bf16.c packs, so quantized weights are dequantized a panel at a time
 * (quant_linear.c). kernels/linear_choice.py measures it against the other candidates.
 *
 *  - W is packed per 64-column panel into pairs, exactly the layout a B tile wants:
 *    tile row p = pair p of 16 columns (gemm_bf16.c pack_panel), K padded to whole tiles
 *    with zeros.
 *  - Four accumulator tiles hold 16 rows x 64 columns; per 32 values of K one A tile of x
 *    and four B tiles of the panel feed four tile products.
 *  - Rows of x are taken 16 at a time straight from x when whole tiles fit (K a multiple
 *    of 32), else from a zero-padded copy, so no tile load reads past x.
 *
 * Linux gives a process AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM):
 * amx_supported() asks once; each thread loads the tile configuration per call.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define VECTORS 4 /* 16-column vectors per panel */

int amx_supported(void) {
    static int state = -1; /* asked once per process; permission covers every thread */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int i = 0; i < 6; i++) { /* 0-3 accumulators, 4 x, 5 W: all 16 rows of 64 bytes */
        config.rows[i] = 16;
        config.colsb[i] = 64;
    }
    _tile_loadconfig(&config);
}

static _Thread_local uint32_t *amx_panel;
static _Thread_local size_t amx_panel_capacity;
static _Thread_local uint16_t *amx_rows;
static _Thread_local size_t amx_rows_capacity;

/* 16 rows x (16 * vectors) columns of the accumulators, with bias, into out. */
static void store_tiles(const float *acc, int rows, int64_t width, const uint16_t *bias, void *out,
                        int64_t out_stride, int out_f32) {
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++)
            store_float(out, r * out_stride + c, acc[r * 16 * VECTORS + c] + (bias ? bf16_to_float(bias[c]) : 0.0f),
                        out_f32);
}

/* The 16-row block at row0 as tile rows: x itself, or a zero-padded copy. */
static const uint16_t *row_block(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int64_t padded_k,
                                 int64_t row0, int64_t *stride) {
    const int64_t rows = m - row0 < 16 ? m - row0 : 16;
    if (rows == 16 && padded_k == k) {
        *stride = x_stride;
        return x + row0 * x_stride;
    }
    uint16_t *copy = grow_buffer((void **)&amx_rows, &amx_rows_capacity, sizeof(uint16_t) * 16 * (size_t)padded_k);
    if (!copy) return NULL;
    memset(copy, 0, sizeof(uint16_t) * 16 * (size_t)padded_k);
    for (int64_t r = 0; r < rows; r++) memcpy(copy + r * padded_k, x + (row0 + r) * x_stride, sizeof(uint16_t) * (size_t)k);
    *stride = padded_k;
    return copy;
}

/* Thread t of nt's share of out = x w^T (+ bias): output columns in 16-column groups, all
 * rows. Returns 0 where it could not run (no memory): the caller takes gemm_bf16.c. */
int gemm_amx_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, void *out,
                  int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t, int nt) {
    int64_t first, last;
    thread_share((n + 15) / 16, 1, t, nt, &first, &last);
    if (first >= last) return 1;
    const int64_t pairs = (k + 1) / 2, padded_pairs = (pairs + 15) / 16 * 16, padded_k = 2 * padded_pairs;
    uint32_t *panel = grow_buffer((void **)&amx_panel, &amx_panel_capacity, sizeof(uint32_t) * (size_t)padded_pairs * VECTORS * 16);
    if (!panel || !grow_buffer((void **)&amx_rows, &amx_rows_capacity, sizeof(uint16_t) * 16 * (size_t)padded_k)) return 0;
    float acc[16 * 16 * VECTORS] __attribute__((aligned(64)));
    configure_tiles();
    for (int64_t g = first; g < last; g += VECTORS) {
        const int vectors = (int)(last - g < VECTORS ? last - g : VECTORS);
        const int64_t col = 16 * g, width = n - col < 16 * vectors ? n - col : 16 * vectors;
        /* K's padding to whole tiles reads as zeros (pack_panel writes the pairs that exist). */
        memset(panel + pairs * vectors * 16, 0, sizeof(uint32_t) * (size_t)(padded_pairs - pairs) * vectors * 16);
        pack_panel(w, n, k, col, vectors, panel);
        const int64_t panel_stride = (int64_t)vectors * 64; /* bytes from one pair to the next */
        for (int64_t row0 = 0; row0 < m; row0 += 16) {
            int64_t stride;
            const uint16_t *a = row_block(x, x_stride, m, k, padded_k, row0, &stride);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t p = 0; p < padded_pairs; p += 16) {
                _tile_loadd(4, a + 2 * p, stride * 2);
                const uint32_t *b = panel + p * vectors * 16;
                _tile_loadd(5, b, panel_stride);
                _tile_dpbf16ps(0, 4, 5);
                if (vectors > 1) { _tile_loadd(5, b + 16, panel_stride); _tile_dpbf16ps(1, 4, 5); }
                if (vectors > 2) { _tile_loadd(5, b + 32, panel_stride); _tile_dpbf16ps(2, 4, 5); }
                if (vectors > 3) { _tile_loadd(5, b + 48, panel_stride); _tile_dpbf16ps(3, 4, 5); }
            }
            _tile_stored(0, acc, 16 * VECTORS * 4);
            if (vectors > 1) _tile_stored(1, acc + 16, 16 * VECTORS * 4);
            if (vectors > 2) _tile_stored(2, acc + 32, 16 * VECTORS * 4);
            if (vectors > 3) _tile_stored(3, acc + 48, 16 * VECTORS * 4);
            const int rows = (int)(m - row0 < 16 ? m - row0 : 16);
            store_tiles(acc, rows, width, bias ? bias + col : NULL, out_at(out, row0 * out_stride + col, out_f32),
                        out_stride, out_f32);
        }
    }
    _tile_release();
    return 1;
}
#else
int amx_supported(void) { return 0; }
int gemm_amx_part(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, void *out,
                  int64_t out_stride, int out_f32, int64_t m, int64_t n, int64_t k, int t, int nt) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)out_stride; (void)out_f32;
    (void)m; (void)n; (void)k; (void)t; (void)nt;
    return 0;
}
#endif
