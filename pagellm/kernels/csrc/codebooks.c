/* Kernels, CPU: the i-quants' codebooks (quant_groups.h Codebooks), set once per library by
 * kernels/codebooks.py, which derives them from the `gguf` package's reference
 * dequantization; the arrays stay owned (and alive) on the Python side (quant_iq3s_words,
 * derived here, is the library's). */
#include <stdint.h>

#include "quant_groups.h"

Codebooks quant_codebooks;
uint16_t quant_iq3s_words[512] __attribute__((aligned(64)));

void quant_set_codebooks(const uint64_t *iq2xxs, const uint64_t *iq2xs, const uint64_t *iq2s, const uint32_t *iq3xxs,
                         const uint32_t *iq3s, const uint64_t *iq1s, const int8_t *iq4nl) {
    quant_codebooks = (Codebooks){iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq4nl};
    /* IQ3_S's four magnitudes (odd, 1 to 15: 4 bits each) of entry e as one 16-bit word for
     * quant_int8_k.c's lookup: magnitudes 0 and 1 in the low nibbles of its two bytes, 2 and 3
     * in the high ones (the order its unpacking takes them back in) */
    for (int e = 0; e < 512; e++) {
        const uint32_t m = iq3s[e];
        quant_iq3s_words[e] = (uint16_t)((m & 15) | ((m >> 16) & 15) << 4 | ((m >> 8) & 15) << 8 | ((m >> 24) & 15) << 12);
    }
}
