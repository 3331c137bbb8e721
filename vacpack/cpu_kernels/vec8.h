// Eight float32 lanes as GCC's vector extension, and the few operations the portable kernels
// (paged_decode.c, varlen_attention_f32.c, elementwise_f32.c, argmax_f32.c,
// token_logprobs.c, gemm_f32.c) build from them.
// Built with -march=native (see build.py), a v8f is an AVX register on x86, a pair of NEON
// registers on ARM, a pair of SSE registers where nothing wider exists. A kernel includes this
// header; the build hashes it with the kernel's source, so a change here rebuilds them all.

#ifndef VACPACK_VEC8_H
#define VACPACK_VEC8_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
    v8f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof(v)); }

// Lanes of two vectors picked by constant indices (0-7: a's, 8-15: b's), in GCC's or clang's
// spelling; the compiler turns each into one or two shuffle instructions.
#if defined(__clang__)
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

// Transposes 8 rows of 8 floats in registers: out[d] holds element d of every row. Three
// rounds: pairs of rows interleaved, pairs of pairs, then the 128-bit halves.
static inline void transpose8x8(const v8f r[8], v8f out[8]) {
    v8f t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = SHUFFLE2(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = SHUFFLE2(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; ++j) {
            u[i + 2 * j] = SHUFFLE2(t[i + j], t[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * j + 1] = SHUFFLE2(t[i + j], t[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    // u[0..3] hold dims (0, 4), (1, 5), (2, 6), (3, 7) of rows 0-3; u[4..7] of rows 4-7.
    for (int d = 0; d < 4; ++d) {
        out[d] = SHUFFLE2(u[d], u[d + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        out[d + 4] = SHUFFLE2(u[d], u[d + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

// bfloat16 as its bits: the upper half of a float32, so widening is a shift.
typedef uint16_t bf16;
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline float bf16_to_float(bf16 x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline bf16 float_to_bf16(float f) {  // round to nearest even, as torch rounds
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

static inline v8f load8_bf16(const bf16* p) {
    v8h half;
    memcpy(&half, p, sizeof(half));
    const v8u bits = __builtin_convertvector(half, v8u) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

// x in every lane: one broadcast (`(v8f){0} + x` costs an add before it, as 0 + -0 is not -0).
static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

// Lanes of a where `mask` is set (all ones), of b elsewhere.
static inline v8f select8(v8i mask, v8f a, v8f b) {
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

// 2^x for x <= 0 on every lane of a float vector of type V (VI: its int32 twin), to float32
// accuracy (relative error below 2e-7): x = n + f with n the nearest integer (adding and
// subtracting 1.5 * 2^23 rounds, exactly for |x| < 2^22) and f in [-0.5, 0.5]; 2^f = e^(f ln 2)
// by its Taylor terms (ln 2)^k / k! to degree 6, 2^n built in the exponent bits. x below -126
// gives 2^-126 (a visible key's weight is never that small against the largest, whose weight is
// 1). A macro over the vector type, so that kernels of 8 lanes and of 16 share the polynomial.
#define EXP2_NONPOSITIVE(V, VI, x_value)                                               \
    __extension__({                                                                    \
        V x_ = (x_value);                                                              \
        const VI clamped_ = x_ < -126.0f;                                              \
        x_ = (V)(((VI)((V){0} - 126.0f) & clamped_) | ((VI)x_ & ~clamped_));           \
        const V n_ = (x_ + 12582912.0f) - 12582912.0f;                                 \
        const V f_ = x_ - n_;                                                          \
        V p_ = (V){0} + 1.5403530e-4f;                                                 \
        p_ = p_ * f_ + 1.3333558e-3f;                                                  \
        p_ = p_ * f_ + 9.6181291e-3f;                                                  \
        p_ = p_ * f_ + 5.5504109e-2f;                                                  \
        p_ = p_ * f_ + 2.4022651e-1f;                                                  \
        p_ = p_ * f_ + 6.9314718e-1f;                                                  \
        p_ = p_ * f_ + 1.0f;                                                           \
        p_ * (V)((__builtin_convertvector(n_, VI) + 127) << 23);                       \
    })

static inline v8f exp2_nonpositive8(v8f x) { return EXP2_NONPOSITIVE(v8f, v8i, x); }

#define LOG2E 1.4426950408889634f  // 1 / ln 2
#define LN2_HI 0.693145751953125f  // ln 2 split in two, so n * LN2_HI is exact for |n| < 2^9
#define LN2_LO 1.428606765330187e-06f

// e^x to about one unit in the last place for x in [-87, 88] (clamped there: e^-87 is still a
// normal float, and a SiLU past either end is its limit to float32 precision anyway).
// x = n ln 2 + r with |r| <= ln 2 / 2 (n rounded by adding and subtracting 1.5 * 2^23), e^r by
// its Taylor series to degree 7, then 2^n built in the exponent bits.
static inline v8f exp8(v8f x) {
    const v8f low = (v8f){0} - 87.0f, high = (v8f){0} + 88.0f;
    x = select8(x < low, low, x);
    x = select8(x > high, high, x);
    const v8f n = (x * LOG2E + 12582912.0f) - 12582912.0f;
    const v8f r = (x - n * LN2_HI) - n * LN2_LO;
    v8f p = (v8f){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v8i exponent_bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8f)exponent_bits;
}

// SiLU on eight lanes as PyTorch computes it, x / (1 + e^-x).
static inline v8f silu8(v8f x) { return x / (1.0f + exp8((v8f){0} - x)); }

#endif
