/* Sampling stage, CPU: set the logits of the tokens a grammar forbids to -inf.
 *
 * The mask is llguidance's bitmask: 32 tokens per int32, bit k of word w is token 32w + k,
 * set = allowed. A grammar's mask is mostly whole words of forbidden tokens (word 0, 32
 * stores) or of allowed ones (word -1, nothing to do); PyTorch needs several passes over
 * every row for the same (unpacking, comparing, filling: ~1 ms at 32 rows of 49k tokens),
 * this is one pass over the words.
 */
#include <stdint.h>

enum { LOGITS_F32 = 0, LOGITS_BF16 = 1, LOGITS_F16 = 2 };

/* logits [rows] each of `vocab` elements, `row_stride` elements apart; bitmask rows are
 * `words` int32 apart; only the rows listed in row_index (count n) are masked. */
void apply_token_bitmask(void *logits, int dtype, int64_t row_stride, int64_t vocab, const int32_t *bitmask,
                         int64_t words, const int64_t *row_index, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = row_index[i];
        const int32_t *mask = bitmask + row * words;
        for (int64_t w = 0; w < words; w++) {
            const uint32_t word = (uint32_t)mask[w];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t first = w * 32;
            const int64_t last = first + 32 < vocab ? first + 32 : vocab;
            if (dtype == LOGITS_F32) {
                uint32_t *out = (uint32_t *)logits + row * row_stride;
                for (int64_t t = first; t < last; t++)
                    if (!((word >> (t - first)) & 1u)) out[t] = 0xFF800000u;
            } else {
                uint16_t *out = (uint16_t *)logits + row * row_stride;
                const uint16_t minus_inf = dtype == LOGITS_BF16 ? 0xFF80u : 0xFC00u;
                for (int64_t t = first; t < last; t++)
                    if (!((word >> (t - first)) & 1u)) out[t] = minus_inf;
            }
        }
    }
}
