/* Subnormal floats in the CPU kernels' parallel regions.
 *
 * On x86 an arithmetic operation that takes or gives a subnormal float (below 1.2e-38)
 * can take a microcode assist of a hundred cycles or more. Softmax weights of keys far
 * below the best score and their products with the values land there, and a decode step
 * of 32 requests spent about 40% of its attention time in them (measured). Such values
 * are far below what a float32 sum or a bf16 result can hold next to the others, so each
 * thread of a kernel region flushes them to zero (FTZ, DAZ) while it runs and restores
 * its previous mode on the way out; nothing outside the kernels is affected.
 */
#ifndef PAGELLM_FLOAT_MODE_H
#define PAGELLM_FLOAT_MODE_H

/* Softmax exponents are clamped here: e^-80 is nothing next to the best key's 1 (and still
 * a normal float), and below about -87 the vector expf leaves its fast path for a
 * scalar one per lane. */
#define SOFTMAX_EXP_FLOOR (-80.0f)

#if defined(__SSE__)
#include <xmmintrin.h>

static inline unsigned subnormals_flushed(void) {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u);  /* FTZ (bit 15) | DAZ (bit 6) */
    return saved;
}

static inline void float_mode_restore(unsigned saved) { _mm_setcsr(saved); }
#else
static inline unsigned subnormals_flushed(void) { return 0; }
static inline void float_mode_restore(unsigned saved) { (void)saved; }
#endif

#endif
