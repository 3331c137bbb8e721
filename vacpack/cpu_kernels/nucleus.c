// The top-p (nucleus) boundary of float32 logits rows without sorting them, in plain C for any
// CPU: per row, the smallest logit of the shortest most-likely-first prefix whose probability
// mass reaches p (a token stays while the mass strictly before it is below p).
//
// Sorting a 151,936-token row to find it took 530-600 ms per 64 rows on a 2-core Zen 3. Here a
// row is read three times: its maximum and the sum of its exponentials (the softmax's
// normaliser); a histogram of probability mass over NUM_BINS bins of the distance below the
// maximum (BIN_RANGE nats, the rest in a last bin); and, once the bins above the boundary are
// known from the histogram, to gather the values of the boundary's own bin alone, which are
// sorted and walked to the exact token. Tokens tied with the boundary's logit all stay (the caller cuts
// at that logit).
//
// Written with GCC's vector extensions and built with -O3 -march=native for the machine at
// hand (see build.py): AVX-512, AVX2 or NEON, whatever the CPU has.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec8.h"

#define NUM_BINS 4096
#define BIN_RANGE 64.0f  // nats below the maximum that the bins cover; below that, the last bin

static int descending(const void* a, const void* b) {
    const float x = *(const float*)a, y = *(const float*)b;
    return (x < y) - (x > y);
}

static inline int bin_of(float distance) {  // distance = max - x >= 0
    const float scaled = distance * (NUM_BINS / BIN_RANGE);
    return scaled < (float)(NUM_BINS - 1) ? (int)scaled : NUM_BINS - 1;
}

// The boundary logit of one row, or -inf where every token stays; NAN where the row has no
// finite maximum or holds a NaN (the caller leaves such rows to its sort). `bins` holds
// NUM_BINS doubles, `values` n floats: the thread's scratch.
static float row_cut(const float* row, int64_t n, float top_p, double* bins, float* values) {
    v8f best = (v8f){0} - INFINITY;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const v8f v = load8(row + j);
        best = select8(v > best, v, best);
    }
    float max = -INFINITY;
    for (int lane = 0; lane < 8; ++lane) max = best[lane] > max ? best[lane] : max;
    for (; j < n; ++j) max = row[j] > max ? row[j] : max;
    if (!isfinite(max)) return NAN;
    // The histogram and the total in one read: weights 2^((x - max) log2 e) <= 1.
    for (int b = 0; b < NUM_BINS; ++b) bins[b] = 0.0;
    const v8f max8 = splat8(max);
    for (j = 0; j + 8 <= n; j += 8) {
        const v8f v = load8(row + j);
        const v8f weight = exp2_nonpositive8((v - max8) * LOG2E);
        for (int lane = 0; lane < 8; ++lane) bins[bin_of(max - v[lane])] += weight[lane];
    }
    for (; j < n; ++j) bins[bin_of(max - row[j])] += exp((double)row[j] - max);
    double total = 0.0;
    for (int b = 0; b < NUM_BINS; ++b) total += bins[b];
    if (!(total > 0.0)) return NAN;  // a NaN in the row
    // The bin where the running mass reaches p.
    const double target = (double)top_p * total;
    double before = 0.0;
    int boundary = 0;
    while (boundary < NUM_BINS - 1 && before + bins[boundary] < target)
        before += bins[boundary++];
    if (before + bins[boundary] < target) return -INFINITY;  // rounding left p out of reach
    // That bin's values, largest first, walked to the token whose mass reaches p.
    int64_t count = 0;
    for (j = 0; j < n; ++j)
        if (bin_of(max - row[j]) == boundary) values[count++] = row[j];
    qsort(values, (size_t)count, sizeof(float), descending);
    for (int64_t i = 0; i < count; ++i) {
        before += exp((double)values[i] - max);
        if (before >= target) return values[i];
    }
    return values[count - 1];
}

// cut[r] = the smallest logit of row r's top-p nucleus (-inf: all stay; NAN: a row without a
// finite maximum), for every row; row_stride in floats. Returns 0, or -1 where memory ran out.
int nucleus_cut_f32(const float* logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                    const float* top_p, float* cut, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        double* bins = malloc(NUM_BINS * sizeof(double));
        float* values = malloc((size_t)vocab * sizeof(float));
        // Every thread takes part in the loop (a worksharing loop needs them all); one
        // without its scratch only reports the failure.
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; ++r) {
            if (bins && values)
                cut[r] = row_cut(logits + r * row_stride, vocab, top_p[r], bins, values);
            else
                failed = 1;
        }
        free(bins);
        free(values);
    }
    return failed ? -1 : 0;
}
