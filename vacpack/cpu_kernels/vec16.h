// Sixteen float32 lanes as GCC's vector extension, for the bf16 kernels (varlen_attention_amx.c,
// paged_decode_amx.c, paged_decode_bf16.c): one AVX-512 register where they run natively, two
// AVX registers in the emulated builds. With the products on the tiles, the softmax and the
// packing around them are most of the AMX kernels' work, so they take the widest registers
// there are (vec8.h's 8 lanes would halve their speed). Only these kernels include it.

#ifndef VACPACK_VEC16_H
#define VACPACK_VEC16_H

#include <stdint.h>
#include <string.h>

#include "vec8.h"

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int16_t v16s __attribute__((vector_size(32)));

// Lanes of two vectors picked by constant indices (0..n-1: a's, n..2n-1: b's), in GCC's or
// clang's spelling; one two-source permute each on AVX-512.
#if defined(__clang__)
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define SHUFFLE_HALVES(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#define SHUFFLE_HALVES(a, b, ...) __builtin_shuffle(a, b, (v16s){__VA_ARGS__})
#endif

static inline v16f load16(const float* p) {
    v16f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

// float32 to bf16, rounding to nearest even (as the CPU's conversion instructions do; no NaN
// reaches here: scores of finite keys and queries are finite).
static inline void store16_bf16(bf16* p, v16f x) {
    v16u bits;
    memcpy(&bits, &x, sizeof(bits));
    const v16u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const v16h half = __builtin_convertvector(rounded, v16h);
    memcpy(p, &half, sizeof(half));
}

// Transposes 16 rows of 16 floats in registers: four rounds of pairing row i with row i + 8,
// their first halves interleaved into row 2i and their second halves into row 2i + 1.
static inline void transpose16x16(v16f rows[16]) {
    for (int round = 0; round < 4; ++round) {
        v16f paired[16];
        for (int i = 0; i < 8; ++i) {
            paired[2 * i] = SHUFFLE16(rows[i], rows[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20,
                                      5, 21, 6, 22, 7, 23);
            paired[2 * i + 1] = SHUFFLE16(rows[i], rows[i + 8], 8, 24, 9, 25, 10, 26, 11, 27,
                                          12, 28, 13, 29, 14, 30, 15, 31);
        }
        memcpy(rows, paired, sizeof(paired));
    }
}

// Two bf16 rows of `dim` elements (a multiple of 16; NULL: a row of zeros) interleaved,
// dst[2d] = even[d] and dst[2d + 1] = odd[d]: the layout of a pair of rows of the reduced
// dimension that the tiles and VDPBF16PS read. Two permutes per 16 elements.
static inline void interleave_rows(const bf16* even, const bf16* odd, int64_t dim, bf16* dst) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        v16h a = {0}, b = {0};
        if (even) memcpy(&a, even + d0, sizeof(a));
        if (odd) memcpy(&b, odd + d0, sizeof(b));
        const v16h low = SHUFFLE_HALVES(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                        7, 23);
        const v16h high = SHUFFLE_HALVES(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14,
                                         30, 15, 31);
        memcpy(dst + 2 * d0, &low, sizeof(low));
        memcpy(dst + 2 * d0 + 16, &high, sizeof(high));
    }
}

#endif
