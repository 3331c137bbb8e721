// bf16 linear layers on AVX512-BF16, y = x @ W^T + bias: bf16 inputs, weights and outputs,
// float32 sums, on VDPBF16PS (Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on).
//
// A weight is packed once (pack_weight_bf16_pairs) into panels of 16 output features, each
// [K / 2][16][2]: at reduction step kk the panel's 16 features' weights for inputs 2kk and
// 2kk + 1 sit side by side in one vector, the pairs VDPBF16PS multiplies and sums into 16
// float32 lanes. The micro-kernel holds an 8-row x 3-panel block of outputs in 24 registers and,
// per step, loads three weight vectors and broadcasts each row's pair of inputs (read in place:
// the inputs need no packing) into 24 dot products. Each thread takes an equal run of the
// panels, in groups of three, and runs every row block over each group: the group's weights
// (K x 96 bytes, 86 KB at K = 896) stay in L2 while the rows stream past, so each weight is
// read from memory once a call (once per chunk of rows, for a prefill's thousands). While a
// group computes, its row blocks request the thread's next group into L2 in shares, a line or
// a few a step (a decode step's weights all come from memory: 2-7% at 16-64 rows, level at
// 2,048, on the 2-core Zen 4). Outputs are rounded to bf16 once, from the float32 sums, after
// the bias.
//
// A gated MLP's [gate; up] projection packed with its halves paired (a panel of 16 gate
// features, then the same 16 up features: gemm.pair_halves) is finished in the same pass:
// silu(gate) * up, from the float32 sums, so the 2x wider [gate | up] never goes to memory.
//
// Against oneDNN's bf16 matmul on a prepacked weight (2-core Zen 4, Qwen2.5-0.5B's shapes):
// bench/linear_kernels_bf16.py and the README's "bf16 linear layers in C".

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "exp2_avx512.h"

#ifdef _OPENMP
#include <omp.h>
#endif

typedef uint16_t bf16;

#define PANEL 16    // output features a panel (one vector of float32 sums)
#define MR 8        // rows of the register block
#define NV 3        // panels of the register block (plain products)
#define NV_GATED 2  // a gate panel and its up panel (gated products)

#define CHUNK_BYTES (512 * 1024)      // a chunk's inputs (see gemm_bf16)
#define AHEAD_MAX_BYTES (256 * 1024)  // the largest next group requested ahead

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of a chunk: a multiple of MR whose k inputs each fill about CHUNK_BYTES.
static inline int64_t chunk_rows_for(int64_t k) {
    const int64_t rows = CHUNK_BYTES / (2 * k) / MR * MR;
    return rows > MR ? rows : MR;
}

// W [n, k] (row stride w_stride) into panels [ceil(n / 16)][ceil(k / 2)][16][2], zeros past n
// and k.
void pack_weight_bf16_pairs(const bf16* w, int64_t n, int64_t k, int64_t w_stride, bf16* packed,
                            int num_threads) {
    const int64_t num_panels = ceil_div(n, PANEL), num_pairs = ceil_div(k, 2);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; ++p) {
        bf16* panel = packed + p * num_pairs * PANEL * 2;
        for (int j = 0; j < PANEL; ++j) {
            const int64_t row = p * PANEL + j;
            for (int64_t kk = 0; kk < 2 * num_pairs; ++kk)
                panel[(kk / 2) * PANEL * 2 + j * 2 + kk % 2] =
                    row < n && kk < k ? w[row * w_stride + kk] : 0;
        }
    }
}

// The pair of inputs (2kk, 2kk + 1) of a row, in every 32-bit lane.
static inline __m512bh input_pair(const bf16* row, int64_t kk) {
    int32_t bits;
    memcpy(&bits, row + 2 * kk, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
}

// An odd k's last input paired with a zero (reading past the row could meet a NaN, and
// NaN x 0 is NaN).
static inline __m512bh last_input(const bf16* row, int64_t k) {
    return (__m512bh)_mm512_set1_epi32((int32_t)row[k - 1]);
}

// silu(g) = g / (1 + e^-g), float32, from e = e^-|g| <= 1 (no overflow for any g): g / (1 + e)
// where g >= 0, g e / (1 + e) where g < 0.
static inline __m512 silu(__m512 g) {
    const __m512 magnitude = _mm512_abs_ps(g);
    const __m512 minus_log2e = _mm512_set1_ps(-1.4426950408889634f);  // e^-|g| = 2^(-|g| log2 e)
    const __m512 e = exp2_nonpositive(_mm512_mul_ps(magnitude, minus_log2e));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
    return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline void store_outputs(bf16* out, __m512 sums, int64_t columns) {
    const __m256i values = (__m256i)_mm512_cvtneps_pbh(sums);
    if (columns >= PANEL)
        _mm256_storeu_si256((__m256i*)out, values);
    else
        _mm256_mask_storeu_epi16(out, (__mmask16)((1u << columns) - 1), values);
}

// One register block: `rows` (<= mr <= MR) rows from x over `nv` (<= NV) panels from
// `panels`, into y. With `gated`, the block is one gate panel and its up panel, and the 16
// outputs are silu(gate) * up. Inlined with constant mr and nv, so that the loops unroll into
// registers.
static inline __attribute__((always_inline)) void register_block(
    const bf16* x, int64_t x_stride, int rows, int mr, int64_t k, const bf16* panels, int nv,
    const float* bias, int gated, bf16* y, int64_t y_stride, int64_t columns, const char* ahead,
    int64_t ahead_lines) {
    const int64_t num_pairs = ceil_div(k, 2);
    // The lines of `ahead` (the thread's next weights) this block requests, a few a step.
    const int64_t lines_per_step = ceil_div(ahead_lines, k / 2 > 0 ? k / 2 : 1);
    const char* const ahead_end = ahead + ahead_lines * 64;
    __m512 acc[MR][NV];
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nv; ++c) acc[r][c] = _mm512_setzero_ps();
    const bf16* row[MR];
    for (int r = 0; r < mr; ++r) row[r] = x + (r < rows ? r : 0) * x_stride;  // extra rows: row 0
    for (int64_t kk = 0; kk < k / 2; ++kk) {
        if (ahead < ahead_end) {
            for (int64_t line = 0; line < lines_per_step; ++line)
                _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
            ahead += lines_per_step * 64;
        }
        __m512bh weights[NV];
        for (int c = 0; c < nv; ++c)
            weights[c] = (__m512bh)_mm512_loadu_si512(panels + (c * num_pairs + kk) * PANEL * 2);
#pragma GCC unroll 8
        for (int r = 0; r < mr; ++r) {
            const __m512bh pair = input_pair(row[r], kk);
#pragma GCC unroll 3
            for (int c = 0; c < nv; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, weights[c]);
        }
    }
    if (k % 2) {
        const int64_t kk = k / 2;
        for (int c = 0; c < nv; ++c) {
            const __m512bh weights =
                (__m512bh)_mm512_loadu_si512(panels + (c * num_pairs + kk) * PANEL * 2);
            for (int r = 0; r < mr; ++r)
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], last_input(row[r], k), weights);
        }
    }
    const int written = rows < mr ? rows : mr;
    for (int c = 0; c < nv; ++c) {
        // A plain bias has n values: the last panel's past n are not read (a paired one is
        // padded to whole panels by its pairing).
        const int64_t valid = gated ? PANEL : columns - c * PANEL;
        const __mmask16 lanes =
            valid >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
        const __m512 b =
            bias ? _mm512_maskz_loadu_ps(lanes, bias + c * PANEL) : _mm512_setzero_ps();
        for (int r = 0; r < written; ++r) acc[r][c] = _mm512_add_ps(acc[r][c], b);
    }
    if (gated) {
        for (int r = 0; r < written; ++r)
            store_outputs(y + r * y_stride, _mm512_mul_ps(silu(acc[r][0]), acc[r][1]), columns);
        return;
    }
    for (int r = 0; r < written; ++r)
        for (int c = 0; c < nv; ++c) {
            const int64_t left = columns - c * PANEL;
            store_outputs(y + r * y_stride + c * PANEL, acc[r][c], left < PANEL ? left : PANEL);
        }
}

// A register block's operands (see register_block); `columns`: y's columns from the block's
// first to its end (a block writes at most NV x 16).
typedef struct {
    const bf16* x;
    int64_t x_stride;
    int rows;
    int64_t k;
    const bf16* panels;
    const float* bias;
    bf16* y;
    int64_t y_stride, columns;
    const char* ahead;  // the lines of the thread's next weights this block requests
    int64_t ahead_lines;
} BlockArgs;

// register_block with constant mr (8, 4, 2 or 1) and nv, by their values.
static inline __attribute__((always_inline)) void block_of_mr(const BlockArgs* a, int mr,
                                                               int nv, int gated) {
    if (gated)
        register_block(a->x, a->x_stride, a->rows, mr, a->k, a->panels, NV_GATED, a->bias, 1,
                       a->y, a->y_stride, a->columns, a->ahead, a->ahead_lines);
    else if (nv == NV)
        register_block(a->x, a->x_stride, a->rows, mr, a->k, a->panels, NV, a->bias, 0, a->y,
                       a->y_stride, a->columns, a->ahead, a->ahead_lines);
    else if (nv == 2)
        register_block(a->x, a->x_stride, a->rows, mr, a->k, a->panels, 2, a->bias, 0, a->y,
                       a->y_stride, a->columns, a->ahead, a->ahead_lines);
    else
        register_block(a->x, a->x_stride, a->rows, mr, a->k, a->panels, 1, a->bias, 0, a->y,
                       a->y_stride, a->columns, a->ahead, a->ahead_lines);
}

static void block_of_rows(const BlockArgs* a, int mr, int nv, int gated) {
    switch (mr) {
        case 8:
            block_of_mr(a, 8, nv, gated);
            break;
        case 4:
            block_of_mr(a, 4, nv, gated);
            break;
        case 2:
            block_of_mr(a, 2, nv, gated);
            break;
        default:
            block_of_mr(a, 1, nv, gated);
    }
}

// y [m, n] (row stride y_stride) = x [m, k] (row stride x_stride) @ W^T + bias, W packed by
// pack_weight_bf16_pairs; bias NULL or n float32 values. With `gated`, the panels pair gate and
// up features 16 by 16 (2 x ceil(n / 16) panels), bias is paired alike (2 x ceil(n / 16) x 16
// values), and y = silu(gate) * up, n wide. Returns 0.
int gemm_bf16(const bf16* x, int64_t m, int64_t k, int64_t x_stride, const bf16* packed,
              int64_t n, const float* bias, int gated, bf16* y, int64_t y_stride,
              int num_threads) {
    const int64_t panel_size = ceil_div(k, 2) * PANEL * 2;
    // Each thread takes an equal run of output panels (of gate/up pairs when gated), in blocks
    // of NV: whole blocks a thread left 10 of 19 to one thread and 9 to the other at n = 896.
    const int64_t num_units = ceil_div(n, PANEL);
    const int64_t panels_per_unit = gated ? 2 : 1, units_per_block = gated ? 1 : NV;
    // Rows in chunks whose inputs fill about half of L2 (512 KB), each chunk meeting all of
    // the thread's panels before the next, so that a block's rows come from L2 rather than L3:
    // 1-3% at 2,048 and 4,096 rows on the 2-core Zen 4 (interleaved, weights from memory).
    const int64_t chunk_rows = chunk_rows_for(k);
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int64_t thread = 0, threads = 1;
#endif
        const int64_t end = num_units * (thread + 1) / threads;
        for (int64_t chunk = 0; chunk < m; chunk += chunk_rows) {
            const int64_t chunk_end = chunk + chunk_rows < m ? chunk + chunk_rows : m;
            for (int64_t unit = num_units * thread / threads; unit < end;
                 unit += units_per_block) {
                const int nv = (int)((end - unit < units_per_block ? end - unit
                                                                   : units_per_block) *
                                     panels_per_unit);
                const int64_t first = unit * panels_per_unit;  // panel
                const int64_t column = unit * PANEL;           // of y
                const float* block_bias = bias ? bias + first * PANEL : NULL;
                const bf16* panels = packed + first * panel_size;
                // The thread's next weights (its next group, or none), requested in shares over
                // this group's row blocks, so that they arrive from memory while these compute.
                const int64_t next = unit + units_per_block;
                const int64_t next_panels =
                    next < end ? ((end - next < units_per_block ? end - next : units_per_block) *
                                  panels_per_unit)
                               : 0;
                const char* ahead = (const char*)(packed + (first + nv) * panel_size);
                const int64_t ahead_bytes = next_panels * panel_size * 2;
                // A long reduction's group (467 KB at k = 4,864) would push the current one
                // out of L2: its rows stream from memory as they are read.
                const int64_t ahead_lines = ahead_bytes <= AHEAD_MAX_BYTES ? ahead_bytes / 64 : 0;
                const int64_t num_blocks = ceil_div(chunk_end - chunk, MR);
                for (int64_t r0 = chunk; r0 < chunk_end; r0 += MR) {
                    const int rows = chunk_end - r0 < MR ? (int)(chunk_end - r0) : MR;
                    const int64_t block = (r0 - chunk) / MR;
                    const int64_t share_start = ahead_lines * block / num_blocks;
                    const int64_t share_end = ahead_lines * (block + 1) / num_blocks;
                    const BlockArgs args = {x + r0 * x_stride, x_stride, rows, k, panels,
                                            block_bias, y + r0 * y_stride + column, y_stride,
                                            n - column, ahead + share_start * 64,
                                            share_end - share_start};
                    // A block of fewer rows (a few decodes) computes fewer: a single row in
                    // an 8-row block multiplied its weights 8 times.
                    if (rows > 4)
                        block_of_rows(&args, 8, nv, gated);
                    else if (rows > 2)
                        block_of_rows(&args, 4, nv, gated);
                    else
                        block_of_rows(&args, rows, nv, gated);
                }
            }
        }
    }
    return 0;
}
