// The elementwise ops of a Llama-style decoder block, fused, on bf16 for x86 CPUs with
// AVX512-BF16: RMSNorm (alone or after the residual add), SiLU(gate) * up, and rotary
// embeddings of the query and key heads.
//
// In PyTorch each of these is several ops (RMSNorm alone is eight), and each reads and writes
// the whole activation and costs a dispatch. Here each row is read once and written once, while
// it sits in L1. Every kernel rounds to bf16 exactly where the reference (transformers' PyTorch
// modules) rounds, so the results equal PyTorch's bit for bit, except that a float32 sum of
// squares in another order, or an exp a unit in the last place apart, can move a value by one
// bf16 step where it lands on a rounding boundary, and the CPU's bf16 conversion flushes
// float32 subnormals (below 1.2e-38) to zero where PyTorch keeps them.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

typedef uint16_t bf16;

#define LOG2E 1.4426950408889634f
#define LN2_HI 0.693145751953125f  // ln 2 split in two, so n * LN2_HI is exact for |n| < 2^9
#define LN2_LO 1.428606765330187e-06f

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
}

// 16 bf16 values (fewer under a mask, the rest 0) widened exactly to float32. Masked loads and
// stores only for a row's tail: on AMD Zen 4 they are slow enough to halve a kernel's speed.
static inline __m512 load_bf16(const bf16* p, __mmask16 mask) {
    const __m256i half = mask == 0xFFFF ? _mm256_loadu_si256((const __m256i*)p)
                                        : _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline void store_bf16(bf16* p, __m512 v, __mmask16 mask) {
    const __m256i half = (__m256i)_mm512_cvtneps_pbh(v);
    if (mask == 0xFFFF)
        _mm256_storeu_si256((__m256i*)p, half);
    else
        _mm256_mask_storeu_epi16(p, mask, half);
}

// Rounds to bf16 (nearest, ties to even) and back: what storing a bf16 tensor between two
// PyTorch ops does to a value.
static inline __m512 round_bf16(__m512 v) {
    const __m256i half = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// e^x in float32 to about one unit in the last place (PyTorch's vectorized exp is within one):
// x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to degree 7 (truncation below
// 6e-9 relative), then scaled by 2^n, which overflows to inf and underflows to 0 as expf does.
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(128.0f)), _mm512_set1_ps(-128.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// out = weight * bf16(r / sqrt(mean(r^2) + eps)) for one row r whose values are already bf16.
static void normalize_row(const bf16* r, const bf16* weight, bf16* out, int64_t n, float eps) {
    __m512 sum_sq = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = load_bf16(r + j, tail_mask(n - j));
        sum_sq = _mm512_fmadd_ps(v, v, sum_sq);
    }
    const float variance = _mm512_reduce_add_ps(sum_sq) / (float)n;
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(variance + eps));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 mask = tail_mask(n - j);
        const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(r + j, mask), scale));
        store_bf16(out + j, _mm512_mul_ps(load_bf16(weight + j, mask), normed), mask);
    }
}

// RMSNorm of each row of x [rows, n] (row stride x_stride) into out [rows, n], contiguous.
void rms_norm_bf16(const bf16* x, int64_t x_stride, const bf16* weight, bf16* out,
                   int64_t num_rows, int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i)
        normalize_row(x + i * x_stride, weight, out + i * n, n, eps);
}

// residual <- bf16(x + residual), then out <- RMSNorm(residual): a pre-norm block's two
// outputs. x, residual and out are [rows, n], contiguous; residual is updated in place.
void add_rms_norm_bf16(const bf16* x, bf16* residual, const bf16* weight, bf16* out,
                       int64_t num_rows, int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i) {
        bf16* r = residual + i * n;
        const bf16* xi = x + i * n;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = tail_mask(n - j);
            store_bf16(r + j, _mm512_add_ps(load_bf16(xi + j, mask), load_bf16(r + j, mask)),
                       mask);
        }
        normalize_row(r, weight, out + i * n, n, eps);
    }
}

// out[i] = bf16(bf16(silu(gate[i])) * up[i]) where row i of gate_up is [gate (n) | up (n)]:
// F.silu(gate) * up as two bf16 ops, with SiLU as PyTorch computes it, x / (1 + e^-x).
void silu_and_mul_bf16(const bf16* gate_up, int64_t gate_up_stride, bf16* out, int64_t num_rows,
                       int64_t n, int num_threads) {
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i) {
        const bf16* gate = gate_up + i * gate_up_stride;
        const bf16* up = gate + n;
        bf16* o = out + i * n;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = tail_mask(n - j);
            const __m512 g = load_bf16(gate + j, mask);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
            store_bf16(o + j, _mm512_mul_ps(silu, load_bf16(up + j, mask)), mask);
        }
    }
}

// Rotates one head in the half-split ("neox") layout: with x = [x1 | x2] and cos, sin of
// half_dim values each, [x1 cos - x2 sin | x2 cos + x1 sin], every product and sum rounded to
// bf16 as PyTorch's ops on bf16 tensors round them.
static inline void rotate_head(const bf16* x, const bf16* cos, const bf16* sin, bf16* out,
                               int64_t half_dim) {
    for (int64_t j = 0; j < half_dim; j += 16) {
        const __mmask16 mask = tail_mask(half_dim - j);
        const __m512 x1 = load_bf16(x + j, mask), x2 = load_bf16(x + half_dim + j, mask);
        const __m512 c = load_bf16(cos + j, mask), s = load_bf16(sin + j, mask);
        const __m512 first = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c)),
                                           round_bf16(_mm512_mul_ps(x2, s)));
        const __m512 second = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)),
                                            round_bf16(_mm512_mul_ps(x1, s)));
        store_bf16(out + j, first, mask);
        store_bf16(out + half_dim + j, second, mask);
    }
}

// Rotary embeddings of the query and key heads of each token, read from their rows (views
// into the fused qkv projection: token strides q_stride and k_stride, heads contiguous within
// a row) and written contiguous to q_out [tokens, q_heads, head_dim] and k_out. Token t's cos
// and sin (half_dim values each) start at cos + t * cos_sin_stride and sin + t * cos_sin_stride.
void rotary_qk_bf16(const bf16* q, int64_t q_stride, int64_t num_q_heads, const bf16* k,
                    int64_t k_stride, int64_t num_k_heads, const bf16* cos, const bf16* sin,
                    int64_t cos_sin_stride, bf16* q_out, bf16* k_out, int64_t num_tokens,
                    int64_t head_dim, int num_threads) {
    const int64_t half_dim = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const bf16* c = cos + t * cos_sin_stride;
        const bf16* s = sin + t * cos_sin_stride;
        for (int64_t h = 0; h < num_q_heads; ++h)
            rotate_head(q + t * q_stride + h * head_dim, c, s,
                        q_out + (t * num_q_heads + h) * head_dim, half_dim);
        for (int64_t h = 0; h < num_k_heads; ++h)
            rotate_head(k + t * k_stride + h * head_dim, c, s,
                        k_out + (t * num_k_heads + h) * head_dim, half_dim);
    }
}
