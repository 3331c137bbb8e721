// Decode attention read straight from a paged KV cache, in plain C for any CPU.
//
// A decode has one query token, so each KV head meets only its few grouped query heads. Done
// with library calls, its keys and values are first gathered out of their pages into a padded
// batch (and transposed), then read again by the attention kernel: each byte of KV crosses the
// memory bus two or three times. Here each key and value row is read once, from its page,
// where it lies: the cache layout [slots, kv_heads, head_dim] already keeps a key's head_dim
// elements contiguous, the layout a dot product reads.
//
// One task is (sequence, range of its keys), every KV head: the task then reads whole slot
// rows, which lie contiguous within a page. Keys are taken KEY_BLOCK at a time (the next
// block's rows prefetched), and per KV head: scores of each grouped query head against each
// key, an online softmax (exp2 by polynomial, in float32), and the value rows accumulated
// into float32 outputs. A sequence's keys are split over several tasks where there are too
// few sequences for the threads (split-K), and the partial results are merged by their
// log-sum-exp afterwards.
//
// Written with eight-lane vectors (GCC's vector extension) and for the compiler's vectoriser,
// built with -O3 -march=native for the machine at hand (see build.py): AVX-512, AVX2 or NEON,
// whatever the CPU has. float32 and bf16 caches; the queries and the output share the cache's
// dtype.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

#define KEY_BLOCK 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256  // a multiple of 8, as every supported head_dim is
// A split of a sequence's keys holds at least this many, so a split's fixed costs (loading
// its queries, writing and merging its partial output) stay small against its reads.
#define MIN_SPLIT_KEYS 256
// Tasks wanted per thread: enough that threads finishing early find more work.
#define TASKS_PER_THREAD 4
#define MAX_SPLITS 64
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef uint16_t bf16;

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

typedef struct {
    const void* q;            // [seqs, heads, head_dim]
    const void* keys;         // the layer's [slots, kv_heads, head_dim]
    const void* values;       // the same
    const int64_t* pages;     // [seqs, pages_per_seq] page ids
    const int64_t* key_range; // [seqs, 2]: first visible key, number of keys
    int64_t num_heads, num_kv_heads, head_dim, page_size, pages_per_seq;
    float scale;
} Problem;

// One task's running result, in floats: per query head the largest score so far (log2 units)
// and the sum of weights, then per query head its weighted values.
static inline int64_t partial_floats(const Problem* pr) {
    return pr->num_heads * (2 + pr->head_dim);
}

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8f load8_bf16(const bf16* p) {
    v8h half;
    memcpy(&half, p, sizeof(half));
    const v8u bits = __builtin_convertvector(half, v8u) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

// Pairwise sums of neighbouring lanes of a and b, per 128-bit half (what x86's hadd does).
static inline v8f pair_sums(v8f a, v8f b) {
    return SHUFFLE2(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE2(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane j of the result is the sum of the lanes of v[j]: eight dot products finished with seven
// shuffled adds, where finishing each alone takes a chain of extracts and adds.
static inline v8f sum_lanes8(const v8f v[8]) {
    const v8f quarter_lo = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
    const v8f quarter_hi = pair_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
    // quarter_lo holds v0..v3's sums over lanes 0-3, then over lanes 4-7; likewise hi.
    return SHUFFLE2(quarter_lo, quarter_hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE2(quarter_lo, quarter_hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp2_nonpositive8 (vec8.h) for one value (a rescale per head and block, a merge weight per
// split).
static inline float exp2_nonpositive(float x) {
    return exp2_nonpositive8((v8f){0} + x)[0];
}

static const v8i LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7};

// The largest of `running` and the first `count` scores of a block.
static inline float block_max(const float* scores, int64_t count, float running) {
    v8f top = (v8f){0} + running;
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
        const v8f s = load8(scores + j0);
        const v8i take = (s > top) & (LANE_INDEX < (v8i){0} + (int32_t)(count - j0));
        top = select8(take, s, top);
    }
    float best = top[0];
    for (int j = 1; j < 8; ++j) best = top[j] > best ? top[j] : best;
    return best;
}

// Replaces the first `count` scores of a block by their weights 2^(score - max) and returns
// the weights' sum (lanes past `count` weigh nothing).
static inline float block_weights(float* scores, int64_t count, float max) {
    v8f total = {0};
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
        const v8i inside = LANE_INDEX < (v8i){0} + (int32_t)(count - j0);
        const v8f weights =
            select8(inside, exp2_nonpositive8(load8(scores + j0) - max), (v8f){0});
        memcpy(scores + j0, &weights, sizeof(weights));
        total += weights;
    }
    return ((total[0] + total[4]) + (total[1] + total[5])) +
           ((total[2] + total[6]) + (total[3] + total[7]));
}

// A cache row as float32 for the products: a float32 row where it lies, a bf16 row converted
// into `buffer` (chunks of eight).
static inline const float* row_in_place(const float* row, v8f* buffer, int64_t chunks) {
    (void)buffer;
    (void)chunks;
    return row;
}

static inline const float* row_as_f32(const bf16* row, v8f* buffer, int64_t chunks) {
    for (int64_t c = 0; c < chunks; ++c) buffer[c] = load8_bf16(row + 8 * c);
    return (const float*)buffer;
}

// The slot of a sequence's key, from its page table.
static inline int64_t slot_of(const Problem* pr, const int64_t* pages, int64_t key) {
    return pages[key / pr->page_size] * pr->page_size + key % pr->page_size;
}

// The body of one task, for a cache of element type T loaded eight at a time by LOAD8 and
// read as float32 rows through AS_FLOAT, with CHUNKS = head_dim / 8: a constant in the
// specialised copies, so that the compiler keeps eight keys' dot products and a head's running
// output in registers; runtime in the generic one.
//
// Scores: per query head, eight keys' dot products at once, finished together by shuffles
// (sum_lanes8) rather than one horizontal sum per key, which cost as much as the products.
// Weights: the block's max and exp2 on eight lanes at a time. Values: per query head, its
// output row stays in registers while the block's value rows stream past from L1. float32 rows
// are read in place; bf16 rows are converted to float32 once per block and KV head. Against
// one dot product per key and a scalar exp, 1.3x on a Zen 3 (64 sequences of 32..1,100 keys,
// the cache evicted between calls, interleaved A/B).
#define DEFINE_ATTEND(NAME, T, LOAD8, AS_FLOAT, CHUNKS)                                        \
    static void NAME(const Problem* pr, int64_t seq, int64_t key_start, int64_t key_end,      \
                     float* part) {                                                           \
        const int64_t group = pr->num_heads / pr->num_kv_heads, dim = pr->head_dim;          \
        const int64_t chunks = (CHUNKS);                                                      \
        const int64_t slot_stride = pr->num_kv_heads * dim, row_bytes = dim * sizeof(T);     \
        const T* q = (const T*)pr->q + seq * pr->num_heads * dim;                             \
        const int64_t* pages = pr->pages + seq * pr->pages_per_seq;                           \
        float* running_max = part;                                                            \
        float* running_sum = part + pr->num_heads;                                            \
        float* running_acc = part + 2 * pr->num_heads;                                        \
        const float scale = pr->scale * LOG2E;                                                \
        for (int64_t h = 0; h < pr->num_heads; ++h) {                                         \
            running_max[h] = -INFINITY;                                                       \
            running_sum[h] = 0.0f;                                                            \
        }                                                                                     \
        memset(running_acc, 0, pr->num_heads * dim * sizeof(float));                          \
        int64_t slots[KEY_BLOCK];                                                             \
        float scores[MAX_GROUP][KEY_BLOCK];                                                   \
        /* Rows `chunks` apart (not MAX_HEAD_DIM): a 1 KiB stride would map every fourth */   \
        /* row to the same L1 sets. */                                                        \
        v8f value_rows[KEY_BLOCK * MAX_HEAD_DIM / 8];                                         \
        v8f queries[MAX_GROUP * MAX_HEAD_DIM / 8];                                            \
        v8f key_rows[8 * MAX_HEAD_DIM / 8]; /* eight bf16 key rows as float32 */              \
        for (int64_t start = key_start; start < key_end; start += KEY_BLOCK) {                \
            const int64_t count = key_end - start < KEY_BLOCK ? key_end - start : KEY_BLOCK;  \
            for (int64_t j = 0; j < count; ++j) slots[j] = slot_of(pr, pages, start + j);    \
            /* The next block's keys and values: pages are scattered over the cache, where */ \
            /* the hardware prefetchers stop at each page's end. */                           \
            for (int64_t key = start + KEY_BLOCK; key < start + 2 * KEY_BLOCK && key < key_end; \
                 ++key) {                                                                     \
                const int64_t slot = slot_of(pr, pages, key);                                 \
                const char* k = (const char*)((const T*)pr->keys + slot * slot_stride);       \
                const char* v = (const char*)((const T*)pr->values + slot * slot_stride);     \
                for (int64_t at = 0; at < pr->num_kv_heads * row_bytes; at += 64) {           \
                    __builtin_prefetch(k + at);                                               \
                    __builtin_prefetch(v + at);                                               \
                }                                                                             \
            }                                                                                 \
            for (int64_t kv_head = 0; kv_head < pr->num_kv_heads; ++kv_head) {                \
                const int64_t first_head = kv_head * group;                                   \
                const T* keys = (const T*)pr->keys + kv_head * dim;                           \
                const T* values = (const T*)pr->values + kv_head * dim;                       \
                for (int64_t h = 0; h < group; ++h)                                           \
                    for (int64_t c = 0; c < chunks; ++c)                                      \
                        queries[h * chunks + c] =                                             \
                            LOAD8(q + (first_head + h) * dim + 8 * c) * scale;                \
                /* Scores eight keys at a time per query head, finished together. A block's */ \
                /* last keys past `count` repeat its last key, and their scores go unread. */   \
                for (int64_t j0 = 0; j0 < count; j0 += 8) {                                   \
                    const float* rows8[8];                                                    \
                    for (int64_t j = 0; j < 8; ++j) {                                         \
                        const int64_t at = j0 + j < count ? j0 + j : count - 1;               \
                        rows8[j] = AS_FLOAT(keys + slots[at] * slot_stride,                   \
                                            &key_rows[j * chunks], chunks);                   \
                    }                                                                         \
                    for (int64_t h = 0; h < group; ++h) {                                     \
                        const v8f* query = &queries[h * chunks];                              \
                        v8f dots[8];                                                          \
                        for (int64_t j = 0; j < 8; ++j) dots[j] = query[0] * load8(rows8[j]); \
                        for (int64_t c = 1; c < chunks; ++c) {                                \
                            const v8f query_chunk = query[c];                                 \
                            for (int64_t j = 0; j < 8; ++j)                                   \
                                dots[j] += query_chunk * load8(rows8[j] + 8 * c);         \
                        }                                                                     \
                        const v8f sums = sum_lanes8(dots);                                    \
                        memcpy(&scores[h][j0], &sums, sizeof(sums));                          \
                    }                                                                         \
                }                                                                             \
                const float* value_rows8[KEY_BLOCK];                                          \
                for (int64_t j = 0; j < count; ++j)                                           \
                    value_rows8[j] = AS_FLOAT(values + slots[j] * slot_stride,                \
                                              &value_rows[j * chunks], chunks);               \
                for (int64_t h = 0; h < group; ++h) {                                         \
                    float* max = &running_max[first_head + h];                                \
                    float* sum = &running_sum[first_head + h];                                \
                    float* acc_out = running_acc + (first_head + h) * dim;                    \
                    const float top = block_max(scores[h], count, *max);                      \
                    /* exp2(-inf) would be 0 too, but -inf - -inf is nan: the first block. */ \
                    const float rescale =                                                     \
                        *max == -INFINITY ? 0.0f : exp2_nonpositive(*max - top);              \
                    const float block_sum = block_weights(scores[h], count, top);             \
                    *sum = *sum * rescale + block_sum;                                        \
                    *max = top;                                                               \
                    v8f acc[MAX_HEAD_DIM / 8];                                                \
                    for (int64_t c = 0; c < chunks; ++c)                                      \
                        acc[c] = load8(acc_out + 8 * c) * rescale;                        \
                    for (int64_t j = 0; j < count; ++j) {                                     \
                        const float weight = scores[h][j];                                    \
                        for (int64_t c = 0; c < chunks; ++c)                                  \
                            acc[c] += weight * load8(value_rows8[j] + 8 * c);             \
                    }                                                                         \
                    memcpy(acc_out, acc, chunks * sizeof(v8f));                               \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_ATTEND(attend_f32, float, load8, row_in_place, pr->head_dim / 8)
DEFINE_ATTEND(attend_bf16, bf16, load8_bf16, row_as_f32, pr->head_dim / 8)
DEFINE_ATTEND(attend_f32_d64, float, load8, row_in_place, 8)
DEFINE_ATTEND(attend_bf16_d64, bf16, load8_bf16, row_as_f32, 8)
DEFINE_ATTEND(attend_f32_d128, float, load8, row_in_place, 16)
DEFINE_ATTEND(attend_bf16_d128, bf16, load8_bf16, row_as_f32, 16)

typedef void (*AttendFunction)(const Problem*, int64_t, int64_t, int64_t, float*);

static AttendFunction attend_for(int64_t head_dim, int is_bf16) {
    if (head_dim == 64) return is_bf16 ? attend_bf16_d64 : attend_f32_d64;
    if (head_dim == 128) return is_bf16 ? attend_bf16_d128 : attend_f32_d128;
    return is_bf16 ? attend_bf16 : attend_f32;
}

// Writes sequence `seq`'s result, merged from its `num_parts` consecutive partials, to out,
// and where lse is given each head's log-sum-exp of its scaled scores (natural log).
static void merge_and_store(const Problem* pr, const float* parts, int64_t num_parts,
                            int64_t seq, void* out, float* lse, int is_bf16) {
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
        for (int64_t d = 0; d < dim; ++d) {
            float value = 0.0f;
            for (int64_t p = 0; p < num_parts; ++p)
                value += weights[p] * parts[p * stride + 2 * pr->num_heads + h * dim + d];
            value /= total;
            if (is_bf16)
                ((bf16*)out)[first + d] = float_to_bf16(value);
            else
                ((float*)out)[first + d] = value;
        }
    }
}

// How many splits a sequence's keys get: enough tasks for the threads, at least
// MIN_SPLIT_KEYS keys per split, at most MAX_SPLITS.
static int64_t splits_for(int64_t num_keys, int64_t num_seqs, int threads) {
    const int64_t wanted = ((int64_t)threads * TASKS_PER_THREAD + num_seqs - 1) / num_seqs;
    int64_t splits = num_keys / MIN_SPLIT_KEYS;
    splits = splits < wanted ? splits : wanted;
    splits = splits < MAX_SPLITS ? splits : MAX_SPLITS;
    return splits < 1 ? 1 : splits;
}

// Returns 0, or -1 where a shape is past the kernel's fixed buffers (the caller checks first)
// or memory runs out.
static int paged_decode(const Problem* pr, void* out, float* lse, int64_t num_seqs,
                        int is_bf16, int threads) {
    const int64_t group = pr->num_heads / pr->num_kv_heads;
    if (group > MAX_GROUP || pr->head_dim > MAX_HEAD_DIM || pr->head_dim % 8) return -1;
    const AttendFunction attend = attend_for(pr->head_dim, is_bf16);
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
        attend(pr, seq, start, end, parts + task * partial_floats(pr));
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t seq = 0; seq < num_seqs; ++seq)
        merge_and_store(pr, parts + first_task[seq] * partial_floats(pr),
                        first_task[seq + 1] - first_task[seq], seq, out, lse, is_bf16);
    free(parts);
    free(first_task);
    return 0;
}

int paged_decode_attention(const void* q, const void* keys, const void* values,
                           const int64_t* pages, const int64_t* key_range, void* out,
                           float* lse, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t page_size, int64_t pages_per_seq,
                           float scale, int is_bf16, int threads) {
    const Problem problem = {q, keys, values, pages, key_range, num_heads, num_kv_heads,
                             head_dim, page_size, pages_per_seq, scale};
    return paged_decode(&problem, out, lse, num_seqs, is_bf16, threads);
}
