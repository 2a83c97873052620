/* Kernels, CPU: the i-quants' codebooks (quant_groups.h Codebooks), set once per library by
 * kernels/codebooks.py, which derives them from the `gguf` package's reference
 * dequantization; the arrays stay owned (and alive) on the Python side. */
#include <stdint.h>

#include "quant_groups.h"

Codebooks quant_codebooks;

void quant_set_codebooks(const uint64_t *iq2xxs, const uint64_t *iq2xs, const uint64_t *iq2s, const uint32_t *iq3xxs,
                         const uint32_t *iq3s, const uint64_t *iq1s, const int8_t *iq4nl) {
    quant_codebooks = (Codebooks){iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq4nl};
}
