// float32 linear layers, y = x @ W^T + bias, for any CPU: a register-blocked matrix product
// over weights packed once at load.
//
// A linear layer's weight never changes, so it is packed once (pack_weight_f32) into panels of
// 16 output features, each panel [K][16]: at step k the 16 weights the 16 outputs need sit in
// two contiguous vectors. The inputs are packed per call into panels of 6 rows, each [K][6].
// The micro-kernel then holds a 6 x 16 block of outputs in 12 vector registers and, per k,
// loads two weight vectors and broadcasts six inputs into 12 fused multiply-adds:
// 12 FMAs per 8 loads, where a plain dot product does one per load. The blocking around it
// keeps the micro-kernel's operands close: a weight micro-panel (one reduction slice x 16)
// in L2 while it meets every 6-row panel of an input block (MC rows of the slice), each
// streamed through L1. A bias and an activation (ReLU, GELU, SiLU) are applied to each output
// block as it is written. A gated MLP's [gate; up] projection packed with its halves paired
// (each panel 8 gate features, then the same 8 up features) is finished in the same pass:
// activation(gate) * up, 8 outputs a panel, so its 2 x wider product never goes to memory.
//
// Threads split the output features (whole panels), each packing the input block it
// reads itself: no barriers, and packing costs K loads per row against N / threads FMAs.
//
// Written with GCC's vector extensions and built with -O3 -march=native for the machine at
// hand (see build.py): AVX2 with FMA is the register budget it is shaped for (16 vector
// registers); AVX-512 and NEON builds run the same code.
//
// The weights may also be kept as bfloat16 (pack_weight_bf16: half the memory, as a bfloat16
// checkpoint holds them) while the arithmetic stays float32: for CPUs without bfloat16
// instructions, where oneDNN's bfloat16 products widen every operand as they go and ran 7x
// slower than float32 on a 2-core Zen 3. Here each panel's reduction slice is widened once
// into a per-thread float32 buffer (a shift per value) before the row tiles that read it, so
// the micro-kernel is the float32 one: 0.95-1.02x its float32 speed there, where widening
// inside the micro-kernel's loop (a load-port-bound loop) ran 1.36-1.59x slower.

#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec8.h"

#define MR 6   // rows of the register block
#define NR 16  // output features of the register block (two vectors)
// The reduction is cut into equal slices of at most KC_MAX: a model's hidden size (896-4,096)
// in one or a few. Every slice past the first reads back and rewrites the outputs it adds to,
// so fewer, longer slices move less: on the 2-core Zen 3, at Qwen2.5-0.5B's shapes, slices of
// at most 1,024 (one for its 896-wide inputs, five of 973 for the 4,864-wide down projection)
// against 256 ran a layer's linears 4.4% faster in ten interleaved runs, faster in every run
// (1-9%: most where other tenants of the host loaded its caches), the decode-sized down
// projection 10-20%, 128- and 256-row products 5-13%.
#define KC_MAX 1024
#define MC 180  // input rows per block (a multiple of MR)
// Inputs up to this size are packed whole and the panels loop outermost (see below).
#define A_ROWS_BYTES (256 * 1024)

// The length of each reduction slice of a k-long reduction (the last may be shorter).
static inline int64_t slice_length(int64_t k) {
    const int64_t num_slices = (k + KC_MAX - 1) / KC_MAX;
    return (k + num_slices - 1) / num_slices;
}

// W [n, k] (row stride w_stride) into panels [ceil(n / 16)][k][16], features past n zero; W's
// values moved as bits, `element_bytes` (4: float32, 2: bfloat16) each.
static void pack_weight(const void* w, int element_bytes, int64_t n, int64_t k,
                        int64_t w_stride, void* packed, int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; ++p) {
        for (int j = 0; j < NR; ++j) {
            const int64_t row = p * NR + j, first = p * k * NR + j;
            const char* source = row < n ? (const char*)w + row * w_stride * element_bytes : NULL;
            if (element_bytes == 4) {  // source NULL: a feature past n, zeros
                const uint32_t* values = (const uint32_t*)source;
                uint32_t* column = (uint32_t*)packed + first;
                for (int64_t kk = 0; kk < k; ++kk) column[kk * NR] = values ? values[kk] : 0;
            } else {
                const uint16_t* values = (const uint16_t*)source;
                uint16_t* column = (uint16_t*)packed + first;
                for (int64_t kk = 0; kk < k; ++kk) column[kk * NR] = values ? values[kk] : 0;
            }
        }
    }
}

void pack_weight_f32(const float* w, int64_t n, int64_t k, int64_t w_stride, float* packed,
                     int num_threads) {
    pack_weight(w, sizeof(float), n, k, w_stride, packed, num_threads);
}

// The same for a bfloat16 W, into bfloat16 panels (the bits as they are).
void pack_weight_bf16(const bf16* w, int64_t n, int64_t k, int64_t w_stride, bf16* packed,
                      int num_threads) {
    pack_weight(w, sizeof(bf16), n, k, w_stride, packed, num_threads);
}

// x[rows, k0:k0+kc] into panels of MR rows, each [kc][MR]; rows past `rows` zero. A whole
// panel goes eight steps of k at a time: its rows' eight values each, transposed in registers,
// stored as eight runs of MR (each vector store's last two lanes are overwritten by the next
// store, the eighth's by the next eight steps, so its last 1-8 steps go value by value and
// nothing is written past the panel). Packing value by value cost a [2,048 x 384] -> 384
// product 20% of its time (every thread packs the rows it reads), this way 6% (2-core Zen 3).
static void pack_rows(const float* x, int64_t x_stride, int64_t rows, int64_t kc, float* out) {
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        float* panel = out + r0 * kc;
        int64_t kk = 0;
        if (r0 + MR <= rows) {
            const float* source[MR];
            for (int r = 0; r < MR; ++r) source[r] = x + (r0 + r) * x_stride;
            for (; kk + 8 < kc; kk += 8) {
                v8f in[8] = {{0}}, steps[8];
                for (int r = 0; r < MR; ++r) in[r] = load8(source[r] + kk);
                transpose8x8(in, steps);
                for (int j = 0; j < 8; ++j) store8(panel + (kk + j) * MR, steps[j]);
            }
        }
        for (int r = 0; r < MR; ++r) {  // the last steps, and every step of a ragged panel
            const float* source = r0 + r < rows ? x + (r0 + r) * x_stride : NULL;
            for (int64_t step = kk; step < kc; ++step)
                panel[step * MR + r] = source ? source[step] : 0.0f;
        }
    }
}

// Activations applied to the outputs as they are written (codes shared with gemm.py).
enum { ACT_NONE = 0, ACT_RELU = 1, ACT_GELU_ERF = 2, ACT_GELU_TANH = 3, ACT_SILU = 4 };

// One call's operands: y[m, n] = activation(x[m, k] @ W^T + bias), strides in floats; or, for
// a weight packed with paired halves (`paired`), y[m, n] = activation(gate) * up.
typedef struct {
    const float* x;
    int64_t m, k, x_stride;
    const void* packed_w;  // float32 panels, or bfloat16 ones where bf16_weights
    int bf16_weights;
    int64_t n;          // y's features (a paired weight's panels hold 2n, rounded up to 16)
    const float* bias;  // or NULL (paired as the weight's features are)
    int activation;
    int paired;
    float* y;
    int64_t y_stride;
    // Where the sums of the reduction's slices before its last are kept: y itself, or for a
    // paired weight, whose y holds half as many values, a buffer of the call's own (a row
    // for each of the m rows, 16 values a panel).
    float* partial;
    int64_t partial_stride;
} Gemm;

static inline v8f abs8(v8f x) { return (v8f)((v8i)x & 0x7fffffff); }

// sign(x) * magnitude, for magnitude >= 0.
static inline v8f with_sign8(v8f magnitude, v8f x) {
    return (v8f)((v8i)magnitude | ((v8i)x & (int32_t)0x80000000));
}

// erf(x) as x P(x^2) / Q(x^2) with P and Q of degree 5 in x^2, fitted minimax (in float64, on
// |x| <= 3.925, past which erf rounds to +-1 in float32, given exactly): within 4.2e-7 of erf
// when evaluated in float32, and about half the operations of an exp-based formula (Abramowitz
// and Stegun 7.1.26, 1.5e-7), which cost an encoder's up projection 12% over a plain product
// where this costs 8% (2-core Zen 3, [2,048-8,192 x 384] -> 1,536).
#define ERF_SATURATION 3.925f
static inline v8f erf8(v8f x) {
    const v8f magnitude = abs8(x);
    const v8i saturated = magnitude > ERF_SATURATION;
    const v8f u = select8(saturated, splat8(ERF_SATURATION), magnitude);
    const v8f t = u * u;
    v8f p = splat8(1.995675802390906e-06f);
    p = p * t + 0.0002961005375254899f;
    p = p * t + 0.004181707743555307f;
    p = p * t + 0.054002609103918076f;
    p = p * t + 0.19985057413578033f;
    p = p * t + 1.1283786296844482f;
    v8f q = splat8(3.812845898210071e-05f);
    q = q * t + 0.001267719198949635f;
    q = q * t + 0.01578725501894951f;
    q = q * t + 0.11802217364311218f;
    q = q * t + 0.5104411840438843f;
    q = q * t + 1.0f;
    return with_sign8(select8(saturated, splat8(1.0f), u * p / q), x);
}

// tanh(x) for x >= 0, as (1 - e) / (1 + e) with e = exp(-2x) <= 1.
static inline v8f tanh_nonnegative8(v8f x) {
    const v8f e = exp2_nonpositive8(-2.8853900817779268f * x);
    return (1.0f - e) / (1.0f + e);
}

static inline v8f activate8(v8f x, int activation) {
    switch (activation) {
        case ACT_RELU:
            return select8(x < 0.0f, splat8(0.0f), x);
        case ACT_GELU_ERF:  // x / 2 (1 + erf(x / sqrt 2)), transformers' "gelu"
            return 0.5f * x * (1.0f + erf8(x * 0.7071067811865476f));
        case ACT_GELU_TANH: {  // x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            const v8f u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            return 0.5f * x * (1.0f + with_sign8(tanh_nonnegative8(abs8(u)), u));
        }
        case ACT_SILU:
            return silu8(x);
        default:
            return x;
    }
}

// One step of k: c[r] += a[r] * b[0:NR] for the first ROWS rows.
static inline __attribute__((always_inline)) void product_step(
    const float* restrict a, const float* restrict b, const int ROWS, v8f c[MR][2]) {
    const v8f b0 = load8(b), b1 = load8(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
        const v8f a_k = splat8(a[r]);
        c[r][0] += a_k * b0, c[r][1] += a_k * b1;
    }
}

// out[r] = a[kc][MR] . b[kc][NR] for the first `ROWS` rows, a compile-time constant at each
// call: ROWS x 2 accumulators in registers, no work for the zero rows of a short last panel (a
// single-sequence decode step computes one row, not six). One 64-byte line of the weight
// micro-panel the caller reads next is prefetched into L2 per step of k over the first
// `ahead_lines` steps, from `ahead` on (see ahead_share), so that a new panel does not wait on
// memory (a decode step streams every weight from memory once). The steps after those run
// the same product in a loop of their own: a test in the loop would cost every step.
static inline __attribute__((always_inline)) void block_product(
    int64_t kc, const float* restrict a, const float* restrict b, const float* ahead,
    int64_t ahead_lines, const int ROWS, v8f out[MR][2]) {
    v8f c[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) c[r][0] = c[r][1] = (v8f){0};
    int64_t kk = 0;
#pragma GCC unroll 4
    for (; kk < ahead_lines; ++kk, a += MR, b += NR) {
        __builtin_prefetch(ahead + kk * NR, 0, 2);
        product_step(a, b, ROWS, c);
    }
#pragma GCC unroll 4
    for (; kk < kc; ++kk, a += MR, b += NR) product_step(a, b, ROWS, c);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) out[r][0] = c[r][0], out[r][1] = c[r][1];
}

// Which lines of the next weight micro-panel the tile-th of a panel's `tiles` row tiles
// prefetches: among many tiles (a prefill's input block) an equal share each, so that the
// panel is asked for once; among a few (a decode step's rows) all of them each. Every tile
// asking for the whole panel again cost a prefill's products 2-10% (a prefetch of a line
// already in L2 still takes a load slot from the product at every step); shared among a few
// tiles the decode-sized products, which wait on memory, ran 5-15% slower (2-core Zen 3).
#define SHARED_AHEAD_MIN_TILES 16
typedef struct {
    int64_t first, lines;
} AheadShare;

static inline AheadShare ahead_share(int64_t tile, int64_t tiles, int64_t kc) {
    if (tiles < SHARED_AHEAD_MIN_TILES) return (AheadShare){0, kc};
    const int64_t first = tile * kc / tiles;
    return (AheadShare){first, (tile + 1) * kc / tiles - first};
}

// Where a block of outputs goes, and what is done to it on the way.
typedef struct {
    float* y;  // the block's first output
    int64_t y_stride;
    const float* partial;  // the sums of earlier slices to add (accumulating), or NULL
    int64_t partial_stride;
    const float* bias;  // added where not accumulating, or NULL
    int activation;     // ACT_NONE but at the reduction's last slice
    int paired;         // y = activation(first vector) * second vector: 8 outputs a row
} BlockOut;

// y[0:rows, 0:cols] = the epilogue of (a[kc][MR] . b[kc][NR] + partial or bias); `cols` counts
// y's columns (at most 8 where paired).
static void micro_kernel(int64_t kc, const float* restrict a, const float* restrict b,
                         const float* ahead, int64_t ahead_lines, const BlockOut* out, int rows,
                         int cols) {
    // The sums this block adds to are read after the loop: fetched now, they arrive while it
    // runs instead of stalling it (a large layer's outputs are far out of cache).
    const float* partial = out->partial;
    if (partial)
        for (int r = 0; r < rows; ++r) __builtin_prefetch(partial + r * out->partial_stride, 1);
    v8f block[MR][2];
    switch (rows) {
        case 1: block_product(kc, a, b, ahead, ahead_lines, 1, block); break;
        case 2: block_product(kc, a, b, ahead, ahead_lines, 2, block); break;
        case 3: block_product(kc, a, b, ahead, ahead_lines, 3, block); break;
        case 4: block_product(kc, a, b, ahead, ahead_lines, 4, block); break;
        case 5: block_product(kc, a, b, ahead, ahead_lines, 5, block); break;
        default: block_product(kc, a, b, ahead, ahead_lines, MR, block); break;
    }
    const int width = out->paired ? NR / 2 : NR;
    // A paired weight's sums and bias are whole panels; elsewhere a ragged block's (the last
    // output features) are `cols` values, read one by one.
    const int whole = out->paired || cols == NR;
    for (int r = 0; r < rows; ++r) {
        v8f low = block[r][0], high = block[r][1];
        const float* base = partial ? partial + r * out->partial_stride : out->bias;
        if (base && whole) {
            low += load8(base), high += load8(base + 8);
        } else if (base) {
            float tile[NR] = {0};
            for (int j = 0; j < cols; ++j) tile[j] = base[j];
            low += load8(tile), high += load8(tile + 8);
        }
        float* row = out->y + r * out->y_stride;
        if (out->paired) {
            low = activate8(low, out->activation) * high;
        } else if (out->activation) {
            low = activate8(low, out->activation), high = activate8(high, out->activation);
        }
        if (cols == width) {
            store8(row, low);
            if (!out->paired) store8(row + 8, high);
        } else {  // a ragged block (the last output features): only its valid part written
            float tile[NR];
            store8(tile, low), store8(tile + 8, high);
            for (int j = 0; j < cols; ++j) row[j] = tile[j];
        }
    }
}

// Panel p's outputs for the rows from `row` on, after the slice [k0, k0 + kc) of the reduction;
// *cols: how many of y's columns the block holds.
static BlockOut block_out(const Gemm* g, int64_t p, int64_t row, int64_t k0, int64_t kc,
                          int* cols) {
    const int last = k0 + kc == g->k;
    BlockOut out = {0};
    out.bias = k0 == 0 && g->bias ? g->bias + p * NR : NULL;
    out.activation = last ? g->activation : ACT_NONE;
    out.paired = g->paired && last;
    out.partial_stride = g->partial_stride;
    if (k0 > 0) out.partial = g->partial + row * g->partial_stride + p * NR;
    if (g->paired && !last) {  // the sums so far, kept whole
        out.y = g->partial + row * g->partial_stride + p * NR;
        out.y_stride = g->partial_stride;
        *cols = NR;
        return out;
    }
    const int64_t width = g->paired ? NR / 2 : NR, first = p * width;
    out.y = g->y + row * g->y_stride + first;
    out.y_stride = g->y_stride;
    *cols = g->n - first < width ? (int)(g->n - first) : (int)width;
    return out;
}

// Panel p's reduction slice [k0, k0 + kc) as float32 ([kc][NR]): in place, or for bfloat16
// panels widened into `wide` (the calling thread's, kc x NR floats) while the slice that is
// read next, `next` values further on (0: none), is asked for line by line, as the micro-kernel
// does for float32 panels.
static const float* panel_slice(const Gemm* g, int64_t p, int64_t k0, int64_t kc, int64_t next,
                                float* wide) {
    const int64_t first = (p * g->k + k0) * NR;
    if (!g->bf16_weights) return (const float*)g->packed_w + first;
    const bf16* source = (const bf16*)g->packed_w + first;
    for (int64_t i = 0; i < kc * NR; i += 8) {
        if (next && i % 32 == 0) __builtin_prefetch(source + next + i, 0, 2);  // 32: a line
        store8(wide + i, load8_bf16(source + i));
    }
    return wide;
}

// One thread's share, panels [panel_begin, panel_end), blocks of MC input rows outermost,
// reduction slices inside: each input block is packed once and meets every panel, and the
// outputs a block adds to (MC rows of the thread's panels) are read back once per slice while
// they are still in L2. With the slices outermost, a large layer's outputs (4,096 rows of a
// [1,536 -> 384] projection: 6 MiB) came back from memory once per slice: 122 GFLOPS where
// this order runs 135 on the 2-core Zen 3, a 2,048-row [4,864 -> 896] projection 139 where it
// runs 156.
static void gemm_blocks_outer(const Gemm* g, int64_t panel_begin, int64_t panel_end,
                              float* a_block, float* wide) {
    const int64_t m = g->m, k = g->k;
    const int64_t slice = slice_length(k);
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mc = m - m0 < MC ? m - m0 : MC;
        for (int64_t k0 = 0; k0 < k; k0 += slice) {
            const int64_t kc = k - k0 < slice ? k - k0 : slice;
            pack_rows(g->x + m0 * g->x_stride + k0, g->x_stride, mc, kc, a_block);
            for (int64_t p = panel_begin; p < panel_end; ++p) {
                const int more = p + 1 < panel_end;
                const float* b = panel_slice(g, p, k0, kc, more ? k * NR : 0, wide);
                // The micro-kernels ask for the next float32 panel (bfloat16: done above).
                const float* ahead = more && !g->bf16_weights ? b + k * NR : b;
                for (int64_t r0 = 0; r0 < mc; r0 += MR) {
                    const int rows = mc - r0 < MR ? (int)(mc - r0) : MR;
                    const AheadShare share = ahead_share(r0 / MR, (mc + MR - 1) / MR, kc);
                    int cols;
                    const BlockOut out = block_out(g, p, m0 + r0, k0, kc, &cols);
                    micro_kernel(kc, a_block + r0 * kc, b, ahead + share.first * NR,
                                 g->bf16_weights ? 0 : share.lines, &out, rows, cols);
                }
            }
        }
    }
}

// The same with panels outermost, for few rows (a decode step): all the inputs are packed
// once (they fit in L2) and each panel's outputs are finished while they are in L1, so a wide
// layer (the vocabulary projection) writes its outputs once instead of once per slice.
static void gemm_panels_outer(const Gemm* g, int64_t panel_begin, int64_t panel_end,
                              float* a_rows, float* wide) {
    const int64_t m = g->m, k = g->k;
    const int64_t m_padded = (m + MR - 1) / MR * MR;
    const int64_t slice = slice_length(k);
    for (int64_t k0 = 0; k0 < k; k0 += slice) {
        const int64_t kc = k - k0 < slice ? k - k0 : slice;
        pack_rows(g->x + k0, g->x_stride, m, kc, a_rows + k0 * m_padded);
    }
    for (int64_t p = panel_begin; p < panel_end; ++p) {
        for (int64_t k0 = 0; k0 < k; k0 += slice) {
            const int64_t kc = k - k0 < slice ? k - k0 : slice;
            const float* a_slice = a_rows + k0 * m_padded;
            // Panels lie one after another, each slice after the last: the next is contiguous.
            const int more = p + 1 < panel_end || k0 + kc < k;
            const float* b = panel_slice(g, p, k0, kc, more ? kc * NR : 0, wide);
            // The micro-kernels ask for the next float32 slice (bfloat16: done above).
            const float* ahead = more && !g->bf16_weights ? b + kc * NR : b;
            const int64_t ahead_lines = g->bf16_weights ? 0 : kc;
            for (int64_t r0 = 0; r0 < m; r0 += MR) {
                const int rows = m - r0 < MR ? (int)(m - r0) : MR;
                int cols;
                const BlockOut out = block_out(g, p, r0, k0, kc, &cols);
                micro_kernel(kc, a_slice + r0 * kc, b, ahead, ahead_lines, &out, rows, cols);
            }
        }
    }
}

// y[m, n] = activation(x[m, k] @ W^T + bias) with W packed by pack_weight_f32, or with
// `bf16_weights` by pack_weight_bf16; bias may be NULL, activation one of ACT_*. With `paired`,
// W is a gated MLP's [gate; up] projection packed with its halves paired (gemm.py: panels of 8
// gate then the same 8 up features, a bias alike) and y[m, n] = activation(x @ gate^T) *
// (x @ up^T). Strides are in floats; y must not overlap x. Returns 0, or -1 where a buffer
// could not be allocated.
int gemm_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const void* packed_w,
             int bf16_weights, int64_t n, const float* bias, int activation, int paired,
             float* y, int64_t y_stride, int num_threads) {
    const int64_t features_per_panel = paired ? NR / 2 : NR;
    const int64_t num_panels = (n + features_per_panel - 1) / features_per_panel;
    if (num_threads > num_panels) num_threads = (int)num_panels;
    if (num_threads < 1) num_threads = 1;
    const int64_t m_padded = (m + MR - 1) / MR * MR;
    const int few_rows = m_padded * k * (int64_t)sizeof(float) <= A_ROWS_BYTES;
    const size_t a_floats =
        (size_t)(few_rows ? m_padded * k : (MC + MR) * slice_length(k));
    // Each thread's buffer: its packed inputs, after a widened bfloat16 panel slice if any
    // (a whole number of 64-byte lines, so the inputs stay aligned).
    const size_t wide_floats = bf16_weights ? (size_t)slice_length(k) * NR : 0;
    Gemm g = {x, m, k, x_stride, packed_w, bf16_weights, n, bias, activation,
              paired, y, y_stride, y, y_stride};
    float* partial = NULL;
    if (paired && slice_length(k) < k) {  // sums of gate and up kept whole until the last slice
        g.partial_stride = num_panels * NR;
        partial = malloc((size_t)m * g.partial_stride * sizeof(float));
        if (!partial) return -1;
        g.partial = partial;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int thread = 0, threads = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num(), threads = omp_get_num_threads();
#endif
        const int64_t panel_begin = num_panels * thread / threads;
        const int64_t panel_end = num_panels * (thread + 1) / threads;
        const size_t buffer_bytes = (wide_floats + a_floats) * sizeof(float);
        float* buffer = aligned_alloc(64, (buffer_bytes + 63) / 64 * 64);
        float* wide = buffer, *a_buffer = buffer + wide_floats;
        if (!buffer) {
            failed = 1;
        } else if (few_rows) {
            gemm_panels_outer(&g, panel_begin, panel_end, a_buffer, wide);
        } else {
            gemm_blocks_outer(&g, panel_begin, panel_end, a_buffer, wide);
        }
        free(buffer);
    }
    free(partial);
    return failed ? -1 : 0;
}
