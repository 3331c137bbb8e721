// Log-probabilities of given tokens straight from [rows, vocab] logits (scoring a corpus, prompt
// and sampled-token logprobs), with each row's log-sum-exp, the token's rank, the row's argmax
// and its top-k logprobs where asked, in plain C for any CPU; float32 or bf16 logits.
//
// Scoring needs one entry of each row's log-softmax: x[t] - logsumexp(x). Through PyTorch that
// is a whole log-softmax (a pass for the maximum, one for the sum, one writing a [rows, vocab]
// result) and a gather, plus an argmax pass when a continuation's greediness is asked, a rank
// count and a top-k for logprobs in generation: on a 2-core Zen 3, 62-115 ms per 256 rows of a
// 151,936-token vocabulary (13-15 ms here), against ~470 ms for the LM head that made them.
// Here each row is read from memory once, CHUNK values at a time: a chunk's maximum and its
// index first (the argmax) and how many of its values reach the target's (the rank), then,
// from L1, the sum of its exponentials against the running maximum, the running sum rescaled
// once per chunk whose maximum is a new one. Chunk sums are added in double, so the sum's
// rounding does not grow with the vocabulary. The top k are kept sorted as the row goes; a
// chunk whose maximum does not beat the k-th best so far is not looked at again (after the
// first few chunks, most are not), one that does is scanned from L1.
//
// Matches torch: a row holding a NaN scores NaN, ranks 0 and its argmax is the first NaN; a
// row whose maximum is infinite scores NaN (inf - inf) and ranks 0. Equal values go in index
// order, in the argmax (the first) and the top k alike. The rank counts the logits at or above
// the target's (a token tied with others ranks behind them, as vLLM counts): exact, where a
// count over rounded log-probabilities may also take in tokens within a rounding step of the
// target.
//
// Written with GCC's vector extensions and built with -O3 -march=native for the machine at
// hand (see build.py): AVX-512, AVX2 or NEON, whatever the CPU has.

#include <math.h>
#include <stdint.h>

#include "vec8.h"

#define CHUNK 1024  // values per chunk: 4 KiB of float32, read a second time from L1

static inline v8i select8i(v8i mask, v8i a, v8i b) { return (a & mask) | (b & ~mask); }

static inline v8f load_values(const void* row, int64_t j, int is_bf16) {
    return is_bf16 ? load8_bf16((const bf16*)row + j) : load8((const float*)row + j);
}

static inline float value_at(const void* row, int64_t j, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const bf16*)row)[j]) : ((const float*)row)[j];
}

// One row's results.
typedef struct {
    float logprob;
    double logsumexp;
    int64_t rank, argmax;
} RowScore;

// The top k so far, best first (`count` of them): values, then their indices.
typedef struct {
    float* values;
    int64_t* indices;
    int64_t k, count;
} TopK;

// Takes in the values of row[start:end] that beat the k-th best so far. Values come in index
// order, so one equal to a kept value goes behind it, and one equal to the k-th stays out.
static void top_k_take(TopK* top, const void* row, int64_t start, int64_t end, int is_bf16) {
    for (int64_t j = start; j < end; ++j) {
        const float value = value_at(row, j, is_bf16);
        if (top->count == top->k && !(value > top->values[top->k - 1])) continue;
        int64_t at = top->count < top->k ? top->count++ : top->k - 1;
        for (; at > 0 && value > top->values[at - 1]; --at) {
            top->values[at] = top->values[at - 1];
            top->indices[at] = top->indices[at - 1];
        }
        top->values[at] = value;
        top->indices[at] = j;
    }
}

static inline __attribute__((always_inline)) RowScore score_row(const void* row, int64_t n,
                                                                int64_t target, int is_bf16,
                                                                TopK* top) {
    const v8i lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const float target_value = value_at(row, target, is_bf16);
    const v8f target_values = splat8(target_value);
    v8i at_least_target = {0};  // per lane, minus the count (a true compare is -1)
    int64_t rank = 0;
    float running_max = -INFINITY;
    int64_t running_index = 0;
    double running_sum = 0.0;  // of 2^((x - running_max) log2 e)
    int saw_nan = 0;
    for (int64_t start = 0; start < n; start += CHUNK) {
        const int64_t end = n - start < CHUNK ? n : start + CHUNK;
        // The chunk's maximum and its first index, in two running vectors (hiding the
        // compare's latency) of eight lanes each.
        v8f best[2] = {(v8f){0} - INFINITY, (v8f){0} - INFINITY};
        v8i best_index[2] = {{0}, {0}};
        v8i nan_lanes = {0};
        int64_t j = start;
        for (; j + 16 <= end; j += 16) {
            for (int k = 0; k < 2; ++k) {
                const v8f v = load_values(row, j + 8 * k, is_bf16);
                nan_lanes |= v != v;
                at_least_target += v >= target_values;
                const v8i greater = v > best[k];
                best[k] = select8(greater, v, best[k]);
                best_index[k] = select8i(greater, lanes + (int32_t)(j + 8 * k), best_index[k]);
            }
        }
        float chunk_max = -INFINITY;
        int64_t chunk_index = start;
        for (int k = 0; k < 2; ++k)
            for (int lane = 0; lane < 8; ++lane) {
                saw_nan |= nan_lanes[lane] != 0;
                const float value = best[k][lane];
                const int64_t index = best_index[k][lane];
                // Lanes never updated hold -inf at index 0: never chosen over a real index.
                if (value > chunk_max || (value == chunk_max && value > -INFINITY &&
                                          index < chunk_index))
                    chunk_max = value, chunk_index = index;
            }
        for (int64_t tail = j; tail < end; ++tail) {
            const float value = value_at(row, tail, is_bf16);
            saw_nan |= value != value;
            rank += value >= target_value;
            if (value > chunk_max) chunk_max = value, chunk_index = tail;
        }
        if (saw_nan) break;
        if (top->k && (top->count < top->k || chunk_max > top->values[top->k - 1]))
            top_k_take(top, row, start, end, is_bf16);
        if (chunk_max > running_max) {
            // exp(-inf) = 0 for the first chunk; later ones scale the sum down.
            running_sum *= exp((double)(running_max - chunk_max));
            running_max = chunk_max, running_index = chunk_index;
        }
        if (!isfinite(running_max)) continue;  // -inf so far, or +inf: settled below
        // The chunk's exponentials against the running maximum (all exponents <= 0).
        const v8f max = splat8(running_max);
        v8f sums[2] = {{0}, {0}};
        for (j = start; j + 16 <= end; j += 16)
            for (int k = 0; k < 2; ++k)
                sums[k] += exp2_nonpositive8((load_values(row, j + 8 * k, is_bf16) - max) * LOG2E);
        double chunk_sum = 0.0;
        for (int lane = 0; lane < 8; ++lane) chunk_sum += (double)sums[0][lane] + sums[1][lane];
        for (; j < end; ++j)
            chunk_sum += exp((double)value_at(row, j, is_bf16) - running_max);
        running_sum += chunk_sum;
    }
    RowScore score = {NAN, NAN, 0, running_index};
    if (saw_nan) {
        score.argmax = 0;
        while (value_at(row, score.argmax, is_bf16) == value_at(row, score.argmax, is_bf16))
            ++score.argmax;
        return score;
    }
    if (!isfinite(running_max)) return score;
    for (int lane = 0; lane < 8; ++lane) rank -= at_least_target[lane];
    // The maximum's own term is 1, so the sum is >= 1 and its log finite.
    const double logsumexp = running_max + log(running_sum);
    score.logprob = (float)(target_value - logsumexp);
    score.logsumexp = logsumexp;
    score.rank = rank;
    return score;
}

// Where the results go: logprobs always, the others unless NULL.
typedef struct {
    float* logprobs;
    float* logsumexp;
    int64_t* ranks;
    int64_t* argmax;
    int64_t top_k;
    float* top_logprobs;  // [rows][top_k]
    int64_t* top_ids;     // [rows][top_k]
} Outputs;

static void score_rows(const void* logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                       const int64_t* targets, Outputs out, int is_bf16, int num_threads) {
    const int64_t element_bytes = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; ++r) {
        const void* row = (const char*)logits + r * row_stride * element_bytes;
        TopK top = {out.top_logprobs + r * out.top_k, out.top_ids + r * out.top_k, out.top_k, 0};
        const RowScore score = score_row(row, vocab, targets[r], is_bf16, &top);
        // A row with a NaN leaves its top k to the caller (torch ranks NaN above everything).
        for (int64_t i = 0; i < top.count; ++i)
            top.values[i] = (float)((double)top.values[i] - score.logsumexp);
        out.logprobs[r] = score.logprob;
        if (out.logsumexp) out.logsumexp[r] = (float)score.logsumexp;
        if (out.ranks) out.ranks[r] = score.rank;
        if (out.argmax) out.argmax[r] = score.argmax;
    }
}

// Per row r: logprobs[r] = log_softmax(logits[r])[targets[r]], logsumexp[r], ranks[r] = how many
// logits are >= the target's, argmax[r] (each of these three unless NULL), and the top_k
// largest logprobs, best first, with their token ids (top_k <= vocab; 0 for none);
// row_stride in elements; every target in [0, vocab).
void token_logprobs_f32(const float* logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                        const int64_t* targets, float* logprobs, float* logsumexp,
                        int64_t* ranks, int64_t* argmax, int64_t top_k, float* top_logprobs,
                        int64_t* top_ids, int num_threads) {
    const Outputs out = {logprobs, logsumexp, ranks, argmax, top_k, top_logprobs, top_ids};
    score_rows(logits, num_rows, vocab, row_stride, targets, out, 0, num_threads);
}

void token_logprobs_bf16(const bf16* logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                         const int64_t* targets, float* logprobs, float* logsumexp,
                         int64_t* ranks, int64_t* argmax, int64_t top_k, float* top_logprobs,
                         int64_t* top_ids, int num_threads) {
    const Outputs out = {logprobs, logsumexp, ranks, argmax, top_k, top_logprobs, top_ids};
    score_rows(logits, num_rows, vocab, row_stride, targets, out, 1, num_threads);
}
