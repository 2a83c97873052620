/* Kernels, CPU: how a linear layer's weight is described to the kernels.
 *
 * A weight W [n, k] is one to three parts stacked along n (the q, k and v projections of
 * a GGUF file may each have their own type, so a fused qkv layer keeps them apart). Each
 * part is bf16 rows or rows of GGUF quantization blocks exactly as the file stores them
 * (row r at data + r * row_bytes), or int8 rows with one float32 scale per row
 * (--quantization int8). The types' numbers are GGML's, so Python passes them through.
 */
#ifndef PAGELLM_WEIGHTS_H
#define PAGELLM_WEIGHTS_H

#include <stdint.h>

enum {
    WEIGHT_F16 = 1,
    WEIGHT_Q4_0 = 2,
    WEIGHT_Q4_1 = 3,
    WEIGHT_Q5_0 = 6,
    WEIGHT_Q5_1 = 7,
    WEIGHT_Q8_0 = 8,
    WEIGHT_Q2_K = 10,
    WEIGHT_Q3_K = 11,
    WEIGHT_Q4_K = 12,
    WEIGHT_Q5_K = 13,
    WEIGHT_Q6_K = 14,
    WEIGHT_IQ2_XXS = 16,
    WEIGHT_IQ2_XS = 17,
    WEIGHT_IQ3_XXS = 18,
    WEIGHT_IQ1_S = 19,
    WEIGHT_IQ4_NL = 20,
    WEIGHT_IQ3_S = 21,
    WEIGHT_IQ2_S = 22,
    WEIGHT_IQ4_XS = 23,
    WEIGHT_IQ1_M = 29,
    WEIGHT_BF16 = 30,
    WEIGHT_TQ1_0 = 34,
    WEIGHT_TQ2_0 = 35,
    WEIGHT_MXFP4 = 39,  /* OCP microscaling: 32 E2M1 values sharing an E8M0 exponent */
    WEIGHT_I8_ROW = 1000,  /* not a GGML type: int8 rows, per-row float32 scales */
    /* Not GGML types: Q4_0 / Q4_1 / MXFP4 rows repacked for the int8-activation kernel (the same
     * bytes as quant_groups.h's layout, the nibbles of each 16 groups in quant_int8.c's lane
     * order); only where that kernel runs. */
    WEIGHT_Q4_0_VNNI = 1002,
    WEIGHT_Q4_1_VNNI = 1003,
    WEIGHT_MXFP4_VNNI = 1004,
};

/* What the kernels need to know of each stored type, in one table: a kernel file that
 * specialises per type keeps an array of its specialisations indexed like this table
 * (weight_type_index), instead of a switch of its own. GGML's block layouts: values per
 * block and the block's bytes; a Q4 row as quant_groups.h stores it has an even number of
 * groups (padded_groups). */
typedef struct {
    int32_t type;
    int32_t block_values;
    int32_t block_bytes;
    int32_t padded_to_even_groups;
} WeightTypeTraits;

enum {
    WEIGHT_INDEX_Q4_0,
    WEIGHT_INDEX_Q4_1,
    WEIGHT_INDEX_Q8_0,
    WEIGHT_INDEX_Q4_K,
    WEIGHT_INDEX_Q5_K,
    WEIGHT_INDEX_Q6_K,
    WEIGHT_INDEX_BF16,
    WEIGHT_INDEX_I8_ROW,
    WEIGHT_INDEX_Q4_0_VNNI,
    WEIGHT_INDEX_Q4_1_VNNI,
    WEIGHT_INDEX_MXFP4_VNNI,
    WEIGHT_INDEX_MXFP4,
    WEIGHT_INDEX_Q5_0,
    WEIGHT_INDEX_Q5_1,
    WEIGHT_INDEX_Q2_K,
    WEIGHT_INDEX_Q3_K,
    WEIGHT_INDEX_IQ4_NL,
    WEIGHT_INDEX_IQ4_XS,
    WEIGHT_INDEX_IQ3_XXS,
    WEIGHT_INDEX_IQ3_S,
    WEIGHT_INDEX_IQ2_XXS,
    WEIGHT_INDEX_IQ2_XS,
    WEIGHT_INDEX_IQ2_S,
    WEIGHT_INDEX_IQ1_S,
    WEIGHT_INDEX_IQ1_M,
    WEIGHT_INDEX_TQ1_0,
    WEIGHT_INDEX_TQ2_0,
    WEIGHT_INDEX_F16,
    WEIGHT_TYPE_COUNT
};

#define Q4_K_BLOCK_BYTES 144
#define Q5_K_BLOCK_BYTES 176
#define Q6_K_BLOCK_BYTES 210

static const WeightTypeTraits WEIGHT_TYPES[WEIGHT_TYPE_COUNT] = {
    [WEIGHT_INDEX_Q4_0] = {WEIGHT_Q4_0, 32, 18, 1},
    [WEIGHT_INDEX_Q4_1] = {WEIGHT_Q4_1, 32, 20, 1},
    [WEIGHT_INDEX_Q8_0] = {WEIGHT_Q8_0, 32, 34, 0},
    [WEIGHT_INDEX_Q4_K] = {WEIGHT_Q4_K, 256, Q4_K_BLOCK_BYTES, 0},
    [WEIGHT_INDEX_Q5_K] = {WEIGHT_Q5_K, 256, Q5_K_BLOCK_BYTES, 0},
    [WEIGHT_INDEX_Q6_K] = {WEIGHT_Q6_K, 256, Q6_K_BLOCK_BYTES, 0},
    [WEIGHT_INDEX_BF16] = {WEIGHT_BF16, 1, 2, 0},
    [WEIGHT_INDEX_I8_ROW] = {WEIGHT_I8_ROW, 1, 1, 0},
    [WEIGHT_INDEX_Q4_0_VNNI] = {WEIGHT_Q4_0_VNNI, 32, 18, 1},
    [WEIGHT_INDEX_Q4_1_VNNI] = {WEIGHT_Q4_1_VNNI, 32, 20, 1},
    [WEIGHT_INDEX_MXFP4_VNNI] = {WEIGHT_MXFP4_VNNI, 32, 17, 1},
    [WEIGHT_INDEX_MXFP4] = {WEIGHT_MXFP4, 32, 17, 1},
    [WEIGHT_INDEX_Q5_0] = {WEIGHT_Q5_0, 32, 22, 0},
    [WEIGHT_INDEX_Q5_1] = {WEIGHT_Q5_1, 32, 24, 0},
    [WEIGHT_INDEX_Q2_K] = {WEIGHT_Q2_K, 256, 84, 0},
    [WEIGHT_INDEX_Q3_K] = {WEIGHT_Q3_K, 256, 110, 0},
    [WEIGHT_INDEX_IQ4_NL] = {WEIGHT_IQ4_NL, 32, 18, 0},
    [WEIGHT_INDEX_IQ4_XS] = {WEIGHT_IQ4_XS, 256, 136, 0},
    [WEIGHT_INDEX_IQ3_XXS] = {WEIGHT_IQ3_XXS, 256, 98, 0},
    [WEIGHT_INDEX_IQ3_S] = {WEIGHT_IQ3_S, 256, 110, 0},
    [WEIGHT_INDEX_IQ2_XXS] = {WEIGHT_IQ2_XXS, 256, 66, 0},
    [WEIGHT_INDEX_IQ2_XS] = {WEIGHT_IQ2_XS, 256, 74, 0},
    [WEIGHT_INDEX_IQ2_S] = {WEIGHT_IQ2_S, 256, 82, 0},
    [WEIGHT_INDEX_IQ1_S] = {WEIGHT_IQ1_S, 256, 50, 0},
    [WEIGHT_INDEX_IQ1_M] = {WEIGHT_IQ1_M, 256, 56, 0},
    [WEIGHT_INDEX_TQ1_0] = {WEIGHT_TQ1_0, 256, 54, 0},
    [WEIGHT_INDEX_TQ2_0] = {WEIGHT_TQ2_0, 256, 66, 0},
    [WEIGHT_INDEX_F16] = {WEIGHT_F16, 32, 64, 0},
};

/* The type's row in WEIGHT_TYPES, or -1 for a type the kernels do not know. */
static inline int weight_type_index(int type) {
    for (int i = 0; i < WEIGHT_TYPE_COUNT; i++)
        if (WEIGHT_TYPES[i].type == type) return i;
    return -1;
}

#define WEIGHT_MAX_PARTS 4

typedef struct {
    int32_t type;
    int64_t rows;
    int64_t row_bytes;
    const uint8_t *data;
    const float *row_scales; /* WEIGHT_I8_ROW only */
} WeightPart;

typedef struct {
    int32_t num_parts;
    WeightPart parts[WEIGHT_MAX_PARTS];
} Weight;

#endif
