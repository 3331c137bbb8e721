// The elementwise ops of a Llama-style decoder block, fused, on float32 for any CPU: RMSNorm
// (alone or after the residual add), SiLU(gate) * up, and rotary embeddings of the query and
// key heads; the float32 twins of elementwise.c, whose bf16 kernels need AVX512-BF16. And an
// encoder block's residual add with LayerNorm (float32 only).
//
// In PyTorch each of these is several ops (RMSNorm alone is five on float32), each reading and
// writing the whole activation. Here each row is read once and written once, while it sits in
// L1. Written with eight-lane vectors (GCC's vector extension) and built with -O3
// -march=native for the machine at hand (see build.py): AVX-512, AVX2 or NEON, whatever the
// CPU has. Results differ from PyTorch's only by float32 rounding: sums of squares added in
// another order, products fused into one rounding where the compiler contracts them, and an
// exp within two units in the last place. (An infinite gate, which no model computes, gives
// an infinite SiLU where PyTorch's gives nan for -inf.)

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

// The first `count` (< 8) values of p, the other lanes 0.
static inline v8f load_tail(const float* p, int64_t count) {
    float lanes[8] = {0};
    memcpy(lanes, p, count * sizeof(float));
    return load8(lanes);
}

static inline void store_tail(float* p, v8f v, int64_t count) {
    float lanes[8];
    store8(lanes, v);
    memcpy(p, lanes, count * sizeof(float));
}

static inline float sum_lanes(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// out = weight * (r / sqrt(mean(r^2) + eps)) for one row r of n values.
static void normalize_row(const float* r, const float* weight, float* out, int64_t n,
                          float eps) {
    const int64_t full = n - n % 8;
    v8f sum_sq = {0};
    for (int64_t j = 0; j < full; j += 8) {
        const v8f v = load8(r + j);
        sum_sq += v * v;
    }
    if (full < n) {
        const v8f v = load_tail(r + full, n - full);
        sum_sq += v * v;
    }
    const float scale = 1.0f / sqrtf(sum_lanes(sum_sq) / (float)n + eps);
    for (int64_t j = 0; j < full; j += 8)
        store8(out + j, load8(weight + j) * (load8(r + j) * scale));
    for (int64_t j = full; j < n; ++j) out[j] = weight[j] * (r[j] * scale);
}

// RMSNorm of each row of x [rows, n] (row stride x_stride) into out [rows, n], contiguous.
void rms_norm_f32(const float* x, int64_t x_stride, const float* weight, float* out,
                  int64_t num_rows, int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i)
        normalize_row(x + i * x_stride, weight, out + i * n, n, eps);
}

// residual <- x + residual, then out <- RMSNorm(residual): a pre-norm block's two outputs.
// x, residual and out are [rows, n], contiguous; residual is updated in place.
void add_rms_norm_f32(const float* x, float* residual, const float* weight, float* out,
                      int64_t num_rows, int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i) {
        float* r = residual + i * n;
        const float* xi = x + i * n;
        for (int64_t j = 0; j < n; ++j) r[j] += xi[j];
        normalize_row(r, weight, out + i * n, n, eps);
    }
}

// out = LayerNorm(x + residual) * weight + bias, row by row: a post-norm (BERT) block's add
// and norm. x, residual and out are [rows, n], contiguous. Each row's sum goes to `out` while
// its mean is summed; a second pass over the row (in L1) sums its deviations from that mean and
// their squares, which correct the mean for its rounding and give the variance without the
// cancellation a sum of squares risks (rows far from zero mean keep full precision). Then the
// row is normalised in place. PyTorch's add writes the sum and its LayerNorm reads it back:
// five passes over the rows' memory where this makes three.
void add_layer_norm_f32(const float* x, const float* residual, const float* weight,
                        const float* bias, float* out, int64_t num_rows, int64_t n, float eps,
                        int num_threads) {
    const int64_t full = n - n % 8, tail = n - full;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i) {
        const float* a = x + i * n;
        const float* b = residual + i * n;
        float* o = out + i * n;
        v8f sum = {0};
        for (int64_t j = 0; j < full; j += 8) {
            const v8f v = load8(a + j) + load8(b + j);
            store8(o + j, v);
            sum += v;
        }
        if (tail) {
            const v8f v = load_tail(a + full, tail) + load_tail(b + full, tail);
            store_tail(o + full, v, tail);
            sum += v;
        }
        const float rough_mean = sum_lanes(sum) / (float)n;
        v8f deviations = {0}, squares = {0};
        for (int64_t j = 0; j < full; j += 8) {
            const v8f d = load8(o + j) - rough_mean;
            deviations += d;
            squares += d * d;
        }
        float tail_deviations = 0.0f, tail_squares = 0.0f;
        for (int64_t j = full; j < n; ++j) {
            const float d = o[j] - rough_mean;
            tail_deviations += d;
            tail_squares += d * d;
        }
        const float shift = (sum_lanes(deviations) + tail_deviations) / (float)n;
        const float variance = (sum_lanes(squares) + tail_squares) / (float)n - shift * shift;
        const float mean = rough_mean + shift;
        const float inverse = 1.0f / sqrtf(variance + eps);
        for (int64_t j = 0; j < full; j += 8)
            store8(o + j, (load8(o + j) - mean) * inverse * load8(weight + j) + load8(bias + j));
        for (int64_t j = full; j < n; ++j) o[j] = (o[j] - mean) * inverse * weight[j] + bias[j];
    }
}

// out[i] = silu(gate[i]) * up[i] where row i of gate_up is [gate (n) | up (n)].
void silu_and_mul_f32(const float* gate_up, int64_t gate_up_stride, float* out,
                      int64_t num_rows, int64_t n, int num_threads) {
    const int64_t full = n - n % 8;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i) {
        const float* gate = gate_up + i * gate_up_stride;
        const float* up = gate + n;
        float* o = out + i * n;
        for (int64_t j = 0; j < full; j += 8)
            store8(o + j, silu8(load8(gate + j)) * load8(up + j));
        if (full < n)
            store_tail(o + full,
                       silu8(load_tail(gate + full, n - full)) * load_tail(up + full, n - full),
                       n - full);
    }
}

// Rotates one head in the half-split ("neox") layout: with x = [x1 | x2] and cos, sin of
// half_dim values each, [x1 cos - x2 sin | x2 cos + x1 sin].
static inline void rotate_head(const float* x, const float* cos, const float* sin, float* out,
                               int64_t half_dim) {
    for (int64_t j = 0; j < half_dim; ++j) {
        const float x1 = x[j], x2 = x[half_dim + j];
        out[j] = x1 * cos[j] - x2 * sin[j];
        out[half_dim + j] = x2 * cos[j] + x1 * sin[j];
    }
}

// Rotary embeddings of the query and key heads of each token, read from their rows (views
// into the fused qkv projection: token strides q_stride and k_stride, heads contiguous within
// a row) and written contiguous to q_out [tokens, q_heads, head_dim] and k_out. Token t's cos
// and sin (half_dim values each) start at cos + t * cos_sin_stride and sin + t * cos_sin_stride.
void rotary_qk_f32(const float* q, int64_t q_stride, int64_t num_q_heads, const float* k,
                   int64_t k_stride, int64_t num_k_heads, const float* cos, const float* sin,
                   int64_t cos_sin_stride, float* q_out, float* k_out, int64_t num_tokens,
                   int64_t head_dim, int num_threads) {
    const int64_t half_dim = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float* c = cos + t * cos_sin_stride;
        const float* s = sin + t * cos_sin_stride;
        for (int64_t h = 0; h < num_q_heads; ++h)
            rotate_head(q + t * q_stride + h * head_dim, c, s,
                        q_out + (t * num_q_heads + h) * head_dim, half_dim);
        for (int64_t h = 0; h < num_k_heads; ++h)
            rotate_head(k + t * k_stride + h * head_dim, c, s,
                        k_out + (t * num_k_heads + h) * head_dim, half_dim);
    }
}
