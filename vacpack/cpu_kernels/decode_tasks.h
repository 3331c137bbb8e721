// A decode's tasks and their partial results, shared by the paged decode kernels
// (paged_decode.c on float32 vectors, paged_decode_bf16.c on VDPBF16PS, paged_decode_amx.c on
// AMX tiles): one task per (sequence, range of its keys), a sequence's keys split over several
// tasks where there are too few sequences for the threads (split-K), each task's partial result
// (per query head its max, its sum of weights and its weighted values) merged with its
// sequence's others by their log-sum-exp.

#ifndef VACPACK_DECODE_TASKS_H
#define VACPACK_DECODE_TASKS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "split_policy.h"
#include "vec8.h"

#define LN2 0.6931471805599453f

typedef struct {
    const void* q;            // [seqs, heads, head_dim]
    const void* keys;         // the layer's [slots, kv_heads, head_dim]
    const void* values;       // the same
    const int64_t* pages;     // [seqs, pages_per_seq] page ids
    const int64_t* key_range; // [seqs, 2]: first visible key, number of keys
    int64_t num_heads, num_kv_heads, head_dim, page_size, pages_per_seq;
    float scale;
    int heads_in_lanes;  // the form: grouped query heads in vector lanes, else apart
    int q_bf16;          // the queries and the output are bf16, else float32
} Problem;

// A group's heads in lanes of eight: how many groups of eight.
static inline int64_t lane_groups(const Problem* pr) {
    return (pr->num_heads / pr->num_kv_heads + 7) / 8;
}

// One task's running result, in floats: per query head the largest score so far (log2 units)
// and the sum of weights, then the weighted values: [heads][head_dim] rows from the
// heads-apart form, [kv_heads][groups of eight heads][head_dim][8 lanes] from the
// heads-in-lanes form.
static inline int64_t partial_floats(const Problem* pr) {
    const int64_t values = pr->heads_in_lanes
                               ? pr->num_kv_heads * lane_groups(pr) * pr->head_dim * 8
                               : pr->num_heads * pr->head_dim;
    return 2 * pr->num_heads + values;
}

// Where head h's first weighted value lies among a partial result's values; the next ones
// follow value_stride apart.
static inline int64_t value_start(const Problem* pr, int64_t h) {
    if (!pr->heads_in_lanes) return h * pr->head_dim;
    const int64_t group = pr->num_heads / pr->num_kv_heads;
    const int64_t kv_head = h / group, g = (h % group) / 8, lane = (h % group) % 8;
    return (kv_head * lane_groups(pr) + g) * pr->head_dim * 8 + lane;
}

static inline int64_t value_stride(const Problem* pr) { return pr->heads_in_lanes ? 8 : 1; }

// exp2_nonpositive8 (vec8.h) for one value (a rescale per head and block, a merge weight per
// split).
static inline float exp2_nonpositive(float x) {
    return exp2_nonpositive8((v8f){0} + x)[0];
}

// The heads-in-lanes forms' online softmax, for one lane group's block of `count` keys'
// scores (log2 units, lane h: head h): the heads' running max and sum taken into lanes (idle
// lanes 0: a finite max and sum nobody reads), *top set to the new max per lane, and the
// factor that rescales the running sum and outputs returned; *total gets the rescaled sum,
// to which the caller adds the block's weights.
static inline v8f lanes_rescale(const v8f* scores, int64_t count, int64_t lanes,
                                const float* running_max, const float* running_sum, v8f* top,
                                v8f* total) {
    v8f old_max = {0}, old_sum = {0};
    for (int64_t h = 0; h < lanes; ++h) {
        old_max[h] = running_max[h];
        old_sum[h] = running_sum[h];
    }
    v8f most = old_max;
    for (int64_t j = 0; j < count; ++j) most = select8(scores[j] > most, scores[j], most);
    // A first block's -inf max gives exp2's floor, 2^-126, times a zero sum and output.
    const v8f rescale = exp2_nonpositive8(old_max - most);
    *top = most;
    *total = old_sum * rescale;
    return rescale;
}

// The lanes' new max and sum back to the heads' running state.
static inline void lanes_store(v8f top, v8f total, int64_t lanes, float* running_max,
                               float* running_sum) {
    for (int64_t h = 0; h < lanes; ++h) {
        running_max[h] = top[h];
        running_sum[h] = total[h];
    }
}

// A kernel's task: keys start..end of sequence `seq` into its partial result (see
// run_decode_tasks).
typedef void (*AttendFunction)(const Problem*, const v8f*, int64_t, int64_t, int64_t, float*);

// Writes sequence `seq`'s result, merged from its `num_parts` consecutive partials, to out,
// and where lse is given each head's log-sum-exp of its scaled scores (natural log).
static void merge_and_store(const Problem* pr, const float* parts, int64_t num_parts,
                            int64_t seq, void* out, float* lse) {
    const int64_t dim = pr->head_dim, stride = partial_floats(pr);
    for (int64_t h = 0; h < pr->num_heads; ++h) {
        float top = -INFINITY;
        for (int64_t p = 0; p < num_parts; ++p) {
            const float part_max = parts[p * stride + h];
            top = part_max > top ? part_max : top;
        }
        float weights[MAX_SPLITS];
        float total = 0.0f;
        for (int64_t p = 0; p < num_parts; ++p) {
            const float part_max = parts[p * stride + h];
            // A split that saw no key (none is empty, but cheap to be safe) weighs nothing.
            weights[p] = part_max == -INFINITY ? 0.0f : exp2_nonpositive(part_max - top);
            total += weights[p] * parts[p * stride + pr->num_heads + h];
        }
        if (lse) lse[seq * pr->num_heads + h] = (top + log2f(total)) * LN2;
        const int64_t first = (seq * pr->num_heads + h) * dim;
        const float* values = parts + 2 * pr->num_heads + value_start(pr, h);
        const int64_t step = value_stride(pr);
        for (int64_t d = 0; d < dim; ++d) {
            float value = 0.0f;
            for (int64_t p = 0; p < num_parts; ++p)
                value += weights[p] * values[p * stride + d * step];
            value /= total;
            if (pr->q_bf16)
                ((bf16*)out)[first + d] = float_to_bf16(value);
            else
                ((float*)out)[first + d] = value;
        }
    }
}

// Runs every task of the problem's sequences with `attend` and writes each sequence's merged
// result to out (and its log-sum-exp to lse, where given). queries_t: per sequence
// queries_t_per_seq vectors that `attend` reads (the heads-in-lanes form's transposed
// queries), or NULL. Returns 0, or -1 when memory runs out.
static int run_decode_tasks(const Problem* pr, AttendFunction attend, const v8f* queries_t,
                            int64_t queries_t_per_seq, void* out, float* lse, int64_t num_seqs,
                            int threads) {
    // Sequence s's splits are tasks first_task[s] ..< first_task[s + 1].
    int64_t* first_task = malloc((num_seqs + 1) * sizeof(int64_t));
    if (!first_task) return -1;
    first_task[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t keys = pr->key_range[2 * s + 1] - pr->key_range[2 * s];
        first_task[s + 1] = first_task[s] + splits_for(keys, num_seqs, threads);
    }
    const int64_t num_tasks = first_task[num_seqs];
    float* parts = malloc(num_tasks * partial_floats(pr) * sizeof(float));
    if (!parts) {
        free(first_task);
        return -1;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < num_tasks; ++task) {
        int64_t seq = 0;  // the sequence whose splits hold this task: few, so a linear search
        while (first_task[seq + 1] <= task) ++seq;
        const int64_t first_key = pr->key_range[2 * seq], end_key = pr->key_range[2 * seq + 1];
        const int64_t num_parts = first_task[seq + 1] - first_task[seq];
        const int64_t per_part = (end_key - first_key + num_parts - 1) / num_parts;
        const int64_t start = first_key + (task - first_task[seq]) * per_part;
        const int64_t end = start + per_part < end_key ? start + per_part : end_key;
        attend(pr, queries_t ? queries_t + seq * queries_t_per_seq : NULL, seq, start, end,
               parts + task * partial_floats(pr));
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t seq = 0; seq < num_seqs; ++seq)
        merge_and_store(pr, parts + first_task[seq] * partial_floats(pr),
                        first_task[seq + 1] - first_task[seq], seq, out, lse);
    free(parts);
    free(first_task);
    return 0;
}

#endif
