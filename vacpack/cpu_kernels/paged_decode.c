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
// rows, which lie contiguous within a page. Keys are taken KEY_BLOCK at a time, each block's
// rows fetched while the block before it is computed (see Ahead), then per KV head: scores of
// each grouped query head against each key, an online softmax (exp2 by polynomial, in
// float32), and the value rows accumulated into float32 outputs, in one of two forms: the
// grouped query heads apart or in vector lanes (block_heads_apart, block_heads_in_lanes),
// which the engine times against each other. A sequence's keys are split over several tasks
// where there are too few sequences for the threads (split-K), and the partial results are
// merged by their log-sum-exp afterwards.
//
// Written with eight-lane vectors (GCC's vector extension) and for the compiler's vectoriser,
// built with -O3 -march=native for the machine at hand (see build.py): AVX-512, AVX2 or NEON,
// whatever the CPU has. float32 and bf16 caches; the queries and the output are float32 or bf16,
// the cache's dtype or float32 over a bf16 cache (float32 arithmetic on a model whose cache is
// kept in bf16).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_tasks.h"
#include "vec8.h"

#define KEY_BLOCK 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256  // a multiple of 8, as every supported head_dim is

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

// Walks a sequence's keys in order, slot by slot, without a division per key.
typedef struct {
    int64_t page, offset;
} SlotCursor;

static inline int64_t next_slot(const Problem* pr, const int64_t* pages, SlotCursor* cursor) {
    const int64_t slot = pages[cursor->page] * pr->page_size + cursor->offset;
    if (++cursor->offset == pr->page_size) {
        cursor->offset = 0;
        ++cursor->page;
    }
    return slot;
}

// A block's key and value rows are fetched while the block before it is computed: its lines
// are prefetched one at a time, at every other step of the products' inner loops, key rows
// first. A decode reads every byte of its KV once, so its time is the reads plus the products
// unless the two overlap, and on a Zen 3 they do not overlap by themselves: a load that misses
// holds up the core's in-order retirement, which runs out of room behind it long before memory
// answers, while a prefetch retires at once. Spread out, the prefetches keep a few lines in
// flight at a time; issued in a burst they queue for the core's few miss buffers and stall the
// products' own loads, and so does a counted loop of lines per step (a constant rhythm lets the
// compiler unroll the loops by two and place the prefetch in one half). The lines the steps do
// not reach (a task's first block; the last rows where the steps are fewer than the lines, as
// for a wide head_dim with few heads per KV head) are read when the block begins, one word per
// line in address order: dense, in-order reads that the hardware prefetchers stream at full
// speed. On G1's decode batch (64 sequences of 32..1,152 keys, 24 layers, 2 threads,
// interleaved, the KV cache float32): 58-65 ms per step against 74-88 ms with every block read
// when it begins, in either form, and no slower with the KV in cache. Both forms are inlined
// into the task, so that this struct stays out of the products' registers and memory.
typedef struct {
    const char* rows[2 * KEY_BLOCK];  // the block's key rows, then its value rows
    int64_t num_rows, row, offset, row_bytes;  // the next line: row `row`, byte `offset`
} Ahead;

static inline void ahead_init(Ahead* ahead, const Problem* pr, const int64_t* slots,
                              int64_t count, int64_t slot_bytes) {
    for (int64_t j = 0; j < count; ++j) {
        ahead->rows[j] = (const char*)pr->keys + slots[j] * slot_bytes;
        ahead->rows[count + j] = (const char*)pr->values + slots[j] * slot_bytes;
    }
    ahead->num_rows = 2 * count;
    ahead->row = ahead->offset = 0;
    ahead->row_bytes = slot_bytes;
}

// Prefetches the next line, if any is left.
static inline void ahead_line(Ahead* ahead) {
    if (ahead->row >= ahead->num_rows) return;
    __builtin_prefetch(ahead->rows[ahead->row] + ahead->offset);
    ahead->offset += 64;
    if (ahead->offset >= ahead->row_bytes) {
        ahead->offset = 0;
        ++ahead->row;
    }
}

// Reads one word of each line not yet prefetched (a row's bytes are a multiple of 16: a
// 4-byte word at each 64-byte step stays inside it).
static inline void ahead_finish(Ahead* ahead) {
    int32_t touched = 0;
    for (; ahead->row < ahead->num_rows; ++ahead->row, ahead->offset = 0) {
        for (; ahead->offset < ahead->row_bytes; ahead->offset += 64) {
            int32_t word;
            memcpy(&word, ahead->rows[ahead->row] + ahead->offset, sizeof(word));
            touched |= word;
        }
    }
    volatile int32_t sink = touched;  // keeps the reads
    (void)sink;
}

// A block's key or value rows of one KV head as float32: float32 rows where they lie, bf16
// rows converted into `buffer` (rows `chunks` vectors apart: a 1 KiB stride would map every
// fourth row to the same L1 sets).
static inline void block_rows(const void* cache, const int64_t* slots, int64_t count,
                              int64_t slot_stride, int64_t kv_head, int64_t chunks, int is_bf16,
                              v8f* buffer, const float** rows) {
    const int64_t dim = 8 * chunks;
    for (int64_t j = 0; j < count; ++j) {
        const int64_t at = slots[j] * slot_stride + kv_head * dim;
        if (!is_bf16) {
            rows[j] = (const float*)cache + at;
            continue;
        }
        const bf16* row = (const bf16*)cache + at;
        for (int64_t c = 0; c < chunks; ++c) buffer[j * chunks + c] = load8_bf16(row + 8 * c);
        rows[j] = (const float*)(buffer + j * chunks);
    }
}

// Adds a block's weighted value rows to one query head's running output, rescaled first (the
// online softmax's correction for a larger max). The output row stays in registers while the
// rows stream past.
static inline void accumulate_values(float* acc_out, float rescale, const float* weights,
                                     const float* const* value_rows, int64_t count,
                                     int64_t chunks, Ahead* ahead) {
    v8f acc[MAX_HEAD_DIM / 8];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = load8(acc_out + 8 * c) * rescale;
    for (int64_t j = 0; j < count; ++j) {
        if (j % 2 == 0) ahead_line(ahead);
        const float weight = weights[j];
        for (int64_t c = 0; c < chunks; ++c) acc[c] += weight * load8(value_rows[j] + 8 * c);
    }
    for (int64_t c = 0; c < chunks; ++c) store8(acc_out + 8 * c, acc[c]);
}

// One KV head's block, heads apart: per query head, eight keys' dot products at once along
// head_dim, finished together by shuffles (sum_lanes8) rather than one horizontal sum per key;
// then per head the block's max and weights on eight lanes, and its values. Few lanes are
// wasted whatever the group size, at the cost of the shuffles.
static inline __attribute__((always_inline)) void block_heads_apart(
    const v8f* queries, const float* const* key_rows, const float* const* value_rows,
    int64_t count, int64_t group, int64_t chunks, float* running_max, float* running_sum,
    float* running_acc, Ahead* ahead) {
    float scores[MAX_GROUP][KEY_BLOCK];
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
        // A block's last keys past `count` repeat its last key; their scores go unread.
        const float* rows8[8];
        for (int64_t j = 0; j < 8; ++j) rows8[j] = key_rows[j0 + j < count ? j0 + j : count - 1];
        for (int64_t h = 0; h < group; ++h) {
            const v8f* query = &queries[h * chunks];
            v8f dots[8];
            ahead_line(ahead);
            for (int64_t j = 0; j < 8; ++j) dots[j] = query[0] * load8(rows8[j]);
            for (int64_t c = 1; c < chunks; ++c) {
                if (c % 2 == 0) ahead_line(ahead);
                for (int64_t j = 0; j < 8; ++j) dots[j] += query[c] * load8(rows8[j] + 8 * c);
            }
            const v8f sums = sum_lanes8(dots);
            memcpy(&scores[h][j0], &sums, sizeof(sums));
        }
    }
    for (int64_t h = 0; h < group; ++h) {
        const float top = block_max(scores[h], count, running_max[h]);
        // exp2(-inf) would be 0 too, but -inf - -inf is nan: the first block.
        const float rescale =
            running_max[h] == -INFINITY ? 0.0f : exp2_nonpositive(running_max[h] - top);
        running_sum[h] = running_sum[h] * rescale + block_weights(scores[h], count, top);
        running_max[h] = top;
        accumulate_values(running_acc + h * 8 * chunks, rescale, scores[h], value_rows, count,
                          chunks, ahead);
    }
}

// One KV head's block, heads in lanes: each vector holds one key's scores for up to eight
// grouped query heads, from the queries transposed (queries_t[d], lane h: head h's element
// d) and each key element broadcast. No horizontal sums, and the block's max, weights and
// rescaling are one vector operation for all the heads; a group smaller than eight leaves
// lanes idle. On a Zen 3 at 7 query heads per KV head: 84-88 against 94-96 ms for the
// heads-apart form in interleaved A/Bs of the kernel alone (64 sequences of 32..1,152 keys,
// 24 layers), level in bench/decode_attention.py's run; at 2 per KV head, 73 against 66 ms.
static inline __attribute__((always_inline)) void block_heads_in_lanes(
    const v8f* queries_t, const float* const* key_rows, const float* const* value_rows,
    int64_t count, int64_t lanes, int64_t chunks, float* running_max, float* running_sum,
    float* outputs_t, Ahead* ahead) {
    const int64_t dim = 8 * chunks;
    v8f scores[KEY_BLOCK];
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
        const float* rows8[8];
        for (int64_t j = 0; j < 8; ++j) rows8[j] = key_rows[j0 + j < count ? j0 + j : count - 1];
        v8f dots[8] = {{0}};
        for (int64_t d = 0; d < dim; ++d) {
            if (d % 2 == 0) ahead_line(ahead);
            const v8f column = queries_t[d];
            for (int64_t j = 0; j < 8; ++j) dots[j] += column * splat8(rows8[j][d]);
        }
        memcpy(&scores[j0], dots, sizeof(dots));
    }
    v8f top, total;
    const v8f rescale =
        lanes_rescale(scores, count, lanes, running_max, running_sum, &top, &total);
    for (int64_t j = 0; j < count; ++j) {
        scores[j] = exp2_nonpositive8(scores[j] - top);
        total += scores[j];
    }
    lanes_store(top, total, lanes, running_max, running_sum);
    // The values with the heads in lanes too: eight of head_dim's elements at a time, each
    // a vector of the heads' running outputs, and each key's weights one vector.
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
        v8f acc[8];
        for (int64_t i = 0; i < 8; ++i) acc[i] = load8(outputs_t + 8 * (d0 + i)) * rescale;
        for (int64_t j = 0; j < count; ++j) {
            if (j % 2 == 0) ahead_line(ahead);
            const v8f weights = scores[j];
            const float* row = value_rows[j] + d0;
            for (int64_t i = 0; i < 8; ++i) acc[i] += weights * splat8(row[i]);
        }
        memcpy(outputs_t + 8 * d0, acc, sizeof(acc));
    }
}

// The keys of the block starting at key `start` of a task ending at `end` (0 past its end).
static inline int64_t block_keys(int64_t start, int64_t end) {
    return start >= end ? 0 : end - start < KEY_BLOCK ? end - start : KEY_BLOCK;
}

// One task: keys key_start..key_end of sequence `seq`, every KV head, into `part` (per query
// head its max in log2 units, its sum of weights, its weighted values). queries_t: the
// sequence's queries transposed per (KV head, group of eight heads), for the heads-in-lanes
// form; NULL for heads apart. Inlined into copies with `chunks` (head_dim / 8) and the cache's
// dtype constant, so that the products keep their operands in registers.
static inline __attribute__((always_inline)) void attend_task(
    const Problem* pr, const v8f* queries_t, int64_t seq, int64_t key_start, int64_t key_end,
    float* part, int kv_bf16, int64_t chunks) {
    const int64_t group = pr->num_heads / pr->num_kv_heads, dim = 8 * chunks;
    const int64_t groups = lane_groups(pr);
    const int64_t slot_stride = pr->num_kv_heads * dim;
    const int64_t slot_bytes = slot_stride * (kv_bf16 ? sizeof(bf16) : sizeof(float));
    const int64_t* pages = pr->pages + seq * pr->pages_per_seq;
    float* running_max = part;
    float* running_sum = part + pr->num_heads;
    float* running_acc = part + 2 * pr->num_heads;
    for (int64_t h = 0; h < pr->num_heads; ++h) {
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    memset(running_acc, 0, (partial_floats(pr) - 2 * pr->num_heads) * sizeof(float));
    const float scale = pr->scale * LOG2E;
    v8f queries[MAX_GROUP * MAX_HEAD_DIM / 8];
    v8f key_buffer[KEY_BLOCK * MAX_HEAD_DIM / 8], value_buffer[KEY_BLOCK * MAX_HEAD_DIM / 8];
    const float* key_rows[KEY_BLOCK];
    const float* value_rows[KEY_BLOCK];
    int64_t slots[KEY_BLOCK], next_slots[KEY_BLOCK];
    SlotCursor cursor = {key_start / pr->page_size, key_start % pr->page_size};
    Ahead ahead;  // the block being fetched
    int64_t count = block_keys(key_start, key_end);
    for (int64_t j = 0; j < count; ++j) slots[j] = next_slot(pr, pages, &cursor);
    ahead_init(&ahead, pr, slots, count, slot_bytes);
    for (int64_t start = key_start; start < key_end; start += KEY_BLOCK) {
        ahead_finish(&ahead);  // this block, all of it now
        // The next block, fetched during this block's products.
        const int64_t next_count = block_keys(start + KEY_BLOCK, key_end);
        for (int64_t j = 0; j < next_count; ++j) next_slots[j] = next_slot(pr, pages, &cursor);
        ahead_init(&ahead, pr, next_slots, next_count, slot_bytes);
        for (int64_t kv_head = 0; kv_head < pr->num_kv_heads; ++kv_head) {
            const int64_t first_head = kv_head * group;
            block_rows(pr->keys, slots, count, slot_stride, kv_head, chunks, kv_bf16,
                       key_buffer, key_rows);
            block_rows(pr->values, slots, count, slot_stride, kv_head, chunks, kv_bf16,
                       value_buffer, value_rows);
            if (queries_t) {
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t first = first_head + 8 * g;
                    const int64_t lanes = group - 8 * g < 8 ? group - 8 * g : 8;
                    const int64_t state = (kv_head * groups + g) * dim;
                    block_heads_in_lanes(queries_t + state, key_rows, value_rows, count, lanes,
                                         chunks, running_max + first, running_sum + first,
                                         running_acc + 8 * state, &ahead);
                }
                continue;
            }
            const void* q = (const char*)pr->q +
                            (seq * pr->num_heads + first_head) * dim *
                                (pr->q_bf16 ? sizeof(bf16) : sizeof(float));
            for (int64_t i = 0; i < group * chunks; ++i)
                queries[i] = (pr->q_bf16 ? load8_bf16((const bf16*)q + 8 * i)
                                         : load8((const float*)q + 8 * i)) *
                             scale;
            block_heads_apart(queries, key_rows, value_rows, count, group, chunks,
                              running_max + first_head, running_sum + first_head,
                              running_acc + first_head * dim, &ahead);
        }
        memcpy(slots, next_slots, next_count * sizeof(int64_t));
        count = next_count;
    }
}

#define DEFINE_ATTEND(NAME, KV_BF16, CHUNKS)                                                  \
    static void NAME(const Problem* pr, const v8f* queries_t, int64_t seq, int64_t key_start, \
                     int64_t key_end, float* part) {                                          \
        attend_task(pr, queries_t, seq, key_start, key_end, part, KV_BF16, CHUNKS);          \
    }

DEFINE_ATTEND(attend_f32, 0, pr->head_dim / 8)
DEFINE_ATTEND(attend_bf16, 1, pr->head_dim / 8)
DEFINE_ATTEND(attend_f32_d64, 0, 8)
DEFINE_ATTEND(attend_bf16_d64, 1, 8)
DEFINE_ATTEND(attend_f32_d128, 0, 16)
DEFINE_ATTEND(attend_bf16_d128, 1, 16)

static AttendFunction attend_for(int64_t head_dim, int kv_bf16) {
    if (head_dim == 64) return kv_bf16 ? attend_bf16_d64 : attend_f32_d64;
    if (head_dim == 128) return kv_bf16 ? attend_bf16_d128 : attend_f32_d128;
    return kv_bf16 ? attend_bf16 : attend_f32;
}

// Every sequence's queries, scaled into log2 units and transposed for the heads-in-lanes
// form: [seqs, kv_heads, groups of eight heads, head_dim] vectors, lane h holding head h of
// its group (idle lanes 0).
static v8f* transposed_queries(const Problem* pr, int64_t num_seqs, int threads) {
    const int64_t group = pr->num_heads / pr->num_kv_heads, dim = pr->head_dim;
    const int64_t per_seq = pr->num_kv_heads * lane_groups(pr) * dim;
    v8f* queries_t = aligned_alloc(sizeof(v8f), num_seqs * per_seq * sizeof(v8f));
    if (!queries_t) return NULL;
    const float scale = pr->scale * LOG2E;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t s = 0; s < num_seqs; ++s) {
        memset(queries_t + s * per_seq, 0, per_seq * sizeof(v8f));
        for (int64_t h = 0; h < pr->num_heads; ++h) {
            const int64_t kv_head = h / group, g = (h % group) / 8, lane = (h % group) % 8;
            v8f* column = queries_t + s * per_seq + (kv_head * lane_groups(pr) + g) * dim;
            const int64_t at = (s * pr->num_heads + h) * dim;
            for (int64_t d = 0; d < dim; ++d)
                column[d][lane] =
                    (pr->q_bf16 ? bf16_to_float(((const bf16*)pr->q)[at + d])
                                : ((const float*)pr->q)[at + d]) *
                    scale;
        }
    }
    return queries_t;
}

// Returns 0, or -1 where a shape is past the kernel's fixed buffers (the caller checks first)
// or memory runs out.
static int paged_decode(const Problem* pr, void* out, float* lse, int64_t num_seqs,
                        int kv_bf16, int threads) {
    const int64_t group = pr->num_heads / pr->num_kv_heads;
    if (group > MAX_GROUP || pr->head_dim > MAX_HEAD_DIM || pr->head_dim % 8) return -1;
    v8f* queries_t = NULL;
    if (pr->heads_in_lanes && !(queries_t = transposed_queries(pr, num_seqs, threads))) return -1;
    const int64_t queries_t_per_seq = pr->num_kv_heads * lane_groups(pr) * pr->head_dim;
    const int status = run_decode_tasks(pr, attend_for(pr->head_dim, kv_bf16), queries_t,
                                        queries_t_per_seq, out, lse, num_seqs, threads);
    free(queries_t);
    return status;
}

int paged_decode_attention(const void* q, const void* keys, const void* values,
                           const int64_t* pages, const int64_t* key_range, void* out,
                           float* lse, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t page_size, int64_t pages_per_seq,
                           float scale, int q_bf16, int kv_bf16, int heads_in_lanes,
                           int threads) {
    const Problem problem = {q, keys, values, pages, key_range, num_heads, num_kv_heads,
                             head_dim, page_size, pages_per_seq, scale, heads_in_lanes,
                             q_bf16};
    return paged_decode(&problem, out, lse, num_seqs, kv_bf16, threads);
}
