// Decode attention over a paged bf16 KV cache with AMX tiles, for x86 CPUs that have them
// (Intel Sapphire Rapids on). The same call, tasks and results as paged_decode.c
// (decode_tasks.h: a task per sequence and range of its keys, split-K, merged by log-sum-exp);
// here both products of each KV head run on the tiles (tiles.h), the softmax in plain C over
// GCC's 16-lane vectors.
//
// A decode has one query token, so a KV head's keys meet only its few grouped query heads,
// and every key row is read once: the kernel is as fast as the rows arrive, provided the work
// per row stays small. Scores are therefore taken transposed, keys times queries: the keys are
// the A operand, whose tile rows are rows of memory, so each tile of 16 keys loads straight
// from its page at the cache's slot stride (no packing, no transposes of keys), and the
// grouped query heads, packed once per task into the B layout, are the columns. A block of
// BLOCK_KEYS keys' scores ([keys][heads]) is transposed in registers to [heads][keys], where
// the online softmax runs only on the group's real heads, and written as bf16 probabilities:
// the A operand of the value product, whose B operand is the block's value rows interleaved
// in key pairs (the tiles' pair layout). The outputs accumulate in float32 tiles, 64 dims at a
// time, kept between blocks in a [heads][head_dim] buffer rescaled where a head's max grows.
//
// Tiles whose keys lie on two pages (pages of other than a multiple of 16 tokens) or reach
// past the task's range (its first and last) are copied first, their missing rows zero. Key
// rows and value rows of invisible keys are never read, and their weights are zero.
//
// Written without an AMX CPU at hand: the tests run it with tiles.h's emulation of the tile
// instructions, and the engine uses it only where it measures faster than the other forms.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_tasks.h"
#include "tiles.h"
#include "vec16.h"
#include "vec8.h"

#define TILE_KEYS 16      // keys per tile of the score product (its rows)
#define BLOCK_KEYS 64     // keys per block of the online softmax: four score tiles
#define PAIR_KEYS 32      // keys per tile of the value product (16 pairs)
#define DIMS_PER_STEP 32  // head dims per step of the score product (a tile row of bf16)
#define MAX_GROUP 16      // query heads per KV head: the columns of a score tile
#define MAX_HEAD_DIM 256

// Where a task's keys and values lie (its key j: slot_offset) and which of them it sees.
typedef struct {
    const bf16* keys;
    const bf16* values;
    const int64_t* pages;                   // the sequence's page table
    int64_t page_size, slot_stride, start, end;  // slot_stride in elements; keys start..end
} TaskRows;

static inline int64_t slot_offset(const TaskRows* rows, int64_t j) {
    return (rows->pages[j / rows->page_size] * rows->page_size + j % rows->page_size) *
           rows->slot_stride;
}

// The 16 keys from `first` (a multiple of 16) as a tile's rows: where they lie when all are
// visible and on one page, else copied into `staged` with invisible rows zero. Sets *stride
// to the rows' distance in bytes.
static inline const bf16* key_tile(const TaskRows* rows, int64_t first, int64_t head_offset,
                                   int64_t head_dim, bf16* staged, int64_t* stride) {
    const int in_range = first >= rows->start && first + TILE_KEYS <= rows->end;
    if (in_range && rows->page_size % TILE_KEYS == 0) {
        *stride = rows->slot_stride * (int64_t)sizeof(bf16);
        return rows->keys + slot_offset(rows, first) + head_offset;
    }
    for (int64_t r = 0; r < TILE_KEYS; ++r) {
        const int64_t j = first + r;
        bf16* dst = staged + r * head_dim;
        if (j >= rows->start && j < rows->end)
            memcpy(dst, rows->keys + slot_offset(rows, j) + head_offset, head_dim * sizeof(bf16));
        else
            memset(dst, 0, head_dim * sizeof(bf16));
    }
    *stride = head_dim * (int64_t)sizeof(bf16);
    return staged;
}

// The block's value rows from `first` interleaved in key pairs, [pair][dim][2 keys], the B
// layout of the value product; invisible keys' rows zero. The next block's key and value rows
// are prefetched meanwhile, a few lines per pair, so that they arrive during this block.
static inline void pack_values(const TaskRows* rows, int64_t first, int64_t head_offset,
                               int64_t head_dim, bf16* packed) {
    const int64_t row_bytes = head_dim * (int64_t)sizeof(bf16);
    for (int64_t pair = 0; pair < BLOCK_KEYS / 2; ++pair) {
        const bf16* sources[2];
        for (int i = 0; i < 2; ++i) {
            const int64_t j = first + 2 * pair + i;
            sources[i] = j >= rows->start && j < rows->end
                             ? rows->values + slot_offset(rows, j) + head_offset
                             : NULL;
            const int64_t ahead = j + BLOCK_KEYS;
            if (ahead < rows->end) {
                const int64_t at = slot_offset(rows, ahead) + head_offset;
                for (int64_t line = 0; line < row_bytes; line += 64) {
                    __builtin_prefetch((const char*)(rows->keys + at) + line);
                    __builtin_prefetch((const char*)(rows->values + at) + line);
                }
            }
        }
        interleave_rows(sources[0], sources[1], head_dim, packed + pair * head_dim * 2);
    }
}

// One KV head's running state over a task's blocks: per query head (a tile row) its largest
// scaled score so far (log2 units), its sum of weights and its weighted values.
typedef struct {
    float max[MAX_GROUP], sum[MAX_GROUP];
    float out[MAX_GROUP * MAX_HEAD_DIM] __attribute__((aligned(64)));
} HeadState;

// The block's softmax: scores [BLOCK_KEYS keys][16 heads] to probabilities [16 heads]
// [BLOCK_KEYS keys] in bf16 (rows past the group untouched, zero), keys first..first + 64 of
// which start..end are visible. Rescales the state's outputs where a head's max grew.
static inline void block_softmax(const float* scores, int64_t first, int64_t start, int64_t end,
                                 int64_t group, int64_t head_dim, float log2_scale,
                                 HeadState* state, bf16* probs) {
    v16f by_head[BLOCK_KEYS / TILE_KEYS][16];  // [tile][head]: a head's 16 keys of the tile
    for (int64_t t = 0; t < BLOCK_KEYS / TILE_KEYS; ++t) {
        for (int k = 0; k < 16; ++k) by_head[t][k] = load16(scores + (t * 16 + k) * 16);
        transpose16x16(by_head[t]);
    }
    const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16i visible[BLOCK_KEYS / TILE_KEYS];
    for (int64_t t = 0; t < BLOCK_KEYS / TILE_KEYS; ++t) {
        const v16i key = lanes + (int32_t)(first + t * 16);
        visible[t] = (key >= (int32_t)start) & (key < (int32_t)end);
    }
    for (int64_t h = 0; h < group; ++h) {
        v16f top = (v16f){0} - INFINITY;
        for (int64_t t = 0; t < BLOCK_KEYS / TILE_KEYS; ++t) {
            by_head[t][h] *= log2_scale;
            const v16i take = visible[t] & (by_head[t][h] > top);
            top = (v16f)(((v16i)by_head[t][h] & take) | ((v16i)top & ~take));
        }
        float block_max = top[0];
        for (int i = 1; i < 16; ++i) block_max = top[i] > block_max ? top[i] : block_max;
        const float old_max = state->max[h];
        const float new_max = block_max > old_max ? block_max : old_max;
        // exp2(-inf) would be 0 too, but -inf - -inf is nan: the first block.
        const float rescale = old_max == -INFINITY ? 0.0f : exp2_nonpositive(old_max - new_max);
        v16f total = {0};
        for (int64_t t = 0; t < BLOCK_KEYS / TILE_KEYS; ++t) {
            const v16f x = by_head[t][h] - new_max;
            const v16f p = (v16f)((v16i)EXP2_NONPOSITIVE(v16f, v16i, x) & visible[t]);
            total += p;
            store16_bf16(probs + h * BLOCK_KEYS + t * 16, p);
        }
        float block_sum = 0.0f;
        for (int i = 0; i < 16; ++i) block_sum += total[i];
        state->sum[h] = state->sum[h] * rescale + block_sum;
        state->max[h] = new_max;
        if (rescale != 1.0f) {
            float* out = state->out + h * head_dim;
            for (int64_t d = 0; d < head_dim; d += 16) {
                const v16f scaled = load16(out + d) * rescale;
                memcpy(out + d, &scaled, sizeof(scaled));
            }
        }
    }
}

// Adds probs [16 heads][BLOCK_KEYS] times the packed values to the state's outputs: per 64
// output dims (the last pass 32), four (two) float32 tiles loaded, a product per 32 keys that
// any visible key falls in, stored back.
static inline void block_values(const bf16* probs, const bf16* packed, int64_t head_dim,
                                int64_t num_key_tiles, float* out) {
    const int64_t out_stride = head_dim * (int64_t)sizeof(float);
    const int64_t pair_stride = head_dim * 2 * (int64_t)sizeof(bf16);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        const int four = head_dim - d0 >= 64;
        TILE_LOAD(4, out + d0, out_stride);
        TILE_LOAD(5, out + d0 + 16, out_stride);
        if (four) {
            TILE_LOAD(6, out + d0 + 32, out_stride);
            TILE_LOAD(7, out + d0 + 48, out_stride);
        }
        for (int64_t k0 = 0; k0 < num_key_tiles * PAIR_KEYS; k0 += PAIR_KEYS) {
            const bf16* step = packed + (k0 / 2) * head_dim * 2 + d0 * 2;
            TILE_LOAD(1, probs + k0, BLOCK_KEYS * sizeof(bf16));
            TILE_LOAD(2, step, pair_stride);
            TILE_DOT(4, 1, 2);
            TILE_LOAD(2, step + 32, pair_stride);
            TILE_DOT(5, 1, 2);
            if (four) {
                TILE_LOAD(2, step + 64, pair_stride);
                TILE_DOT(6, 1, 2);
                TILE_LOAD(2, step + 96, pair_stride);
                TILE_DOT(7, 1, 2);
            }
        }
        TILE_STORE(4, out + d0, out_stride);
        TILE_STORE(5, out + d0 + 16, out_stride);
        if (four) {
            TILE_STORE(6, out + d0 + 32, out_stride);
            TILE_STORE(7, out + d0 + 48, out_stride);
        }
    }
}

// One task (decode_tasks.h's AttendFunction; no transposed queries): keys key_start..key_end
// of sequence `seq`, every KV head in turn, into `part` (heads-apart layout).
static void attend_tiles(const Problem* pr, const v8f* unused, int64_t seq, int64_t key_start,
                         int64_t key_end, float* part) {
    (void)unused;
    const int64_t group = pr->num_heads / pr->num_kv_heads, dim = pr->head_dim;
    const TaskRows rows = {pr->keys, pr->values, pr->pages + seq * pr->pages_per_seq,
                           pr->page_size, pr->num_kv_heads * dim, key_start, key_end};
    const float log2_scale = pr->scale * LOG2E;
    // The queries in the B layout, per step of 32 dims: [pair][16 heads][2 dims].
    uint32_t queries[MAX_HEAD_DIM / 2 * MAX_GROUP] __attribute__((aligned(64)));
    float scores[BLOCK_KEYS * MAX_GROUP] __attribute__((aligned(64)));
    bf16 probs[MAX_GROUP * BLOCK_KEYS] __attribute__((aligned(64)));
    bf16 staged[TILE_KEYS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    bf16 packed[BLOCK_KEYS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    HeadState state;
    memset(probs, 0, sizeof(probs));  // rows past the group stay zero
    const int64_t aligned_start = key_start - key_start % TILE_KEYS;
    tiles_configure();
    for (int64_t kv_head = 0; kv_head < pr->num_kv_heads; ++kv_head) {
        const int64_t first_head = kv_head * group, head_offset = kv_head * dim;
        memset(queries, 0, dim / 2 * MAX_GROUP * sizeof(uint32_t));
        const bf16* q = (const bf16*)pr->q + (seq * pr->num_heads + first_head) * dim;
        for (int64_t h = 0; h < group; ++h)
            for (int64_t pair = 0; pair < dim / 2; ++pair)
                memcpy(&queries[pair * MAX_GROUP + h], q + h * dim + 2 * pair, sizeof(uint32_t));
        for (int64_t h = 0; h < MAX_GROUP; ++h) {
            state.max[h] = -INFINITY;
            state.sum[h] = 0.0f;
        }
        memset(state.out, 0, MAX_GROUP * dim * sizeof(float));
        for (int64_t first = aligned_start; first < key_end; first += BLOCK_KEYS) {
            const int64_t block_end = first + BLOCK_KEYS < key_end ? first + BLOCK_KEYS : key_end;
            const int64_t num_tiles = (block_end - first + TILE_KEYS - 1) / TILE_KEYS;
            for (int64_t t = 0; t < BLOCK_KEYS / TILE_KEYS; ++t) {
                if (t >= num_tiles) {  // past the task's keys: invisible, never computed
                    memset(scores + t * TILE_KEYS * MAX_GROUP, 0,
                           TILE_KEYS * MAX_GROUP * sizeof(float));
                    continue;
                }
                int64_t stride;
                const bf16* tile = key_tile(&rows, first + t * TILE_KEYS, head_offset, dim,
                                            staged, &stride);
                TILE_ZERO(0);
                for (int64_t d0 = 0; d0 < dim; d0 += DIMS_PER_STEP) {
                    TILE_LOAD(1, tile + d0, stride);
                    TILE_LOAD(2, queries + d0 / 2 * MAX_GROUP, MAX_GROUP * sizeof(uint32_t));
                    TILE_DOT(0, 1, 2);
                }
                TILE_STORE(0, scores + t * TILE_KEYS * MAX_GROUP, MAX_GROUP * sizeof(float));
            }
            block_softmax(scores, first, key_start, key_end, group, dim, log2_scale, &state,
                          probs);
            pack_values(&rows, first, head_offset, dim, packed);
            block_values(probs, packed, dim, (num_tiles * TILE_KEYS + PAIR_KEYS - 1) / PAIR_KEYS,
                         state.out);
        }
        for (int64_t h = 0; h < group; ++h) {
            part[first_head + h] = state.max[h];
            part[pr->num_heads + first_head + h] = state.sum[h];
            memcpy(part + 2 * pr->num_heads + (first_head + h) * dim, state.out + h * dim,
                   dim * sizeof(float));
        }
    }
    tiles_release();
}

// 0 once the process may use the tiles (Linux grants their state on request), else minus
// the request's errno: call before paged_decode_amx.
int paged_decode_amx_ready(void) { return tiles_request_permission(); }

// paged_decode_attention's call (paged_decode.c) for bf16 queries, cache and output: -1 where
// the shape is past the kernel (group over 16, head_dim not a multiple of 32 or over 256) or
// memory runs out.
int paged_decode_amx(const bf16* q, const bf16* keys, const bf16* values, const int64_t* pages,
                     const int64_t* key_range, bf16* out, float* lse, int64_t num_seqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t page_size, int64_t pages_per_seq, float scale, int threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % DIMS_PER_STEP) return -1;
    const Problem problem = {q, keys, values, pages, key_range, num_heads, num_kv_heads,
                             head_dim, page_size, pages_per_seq, scale, 0, 1};
    return run_decode_tasks(&problem, attend_tiles, NULL, 0, out, lse, num_seqs, threads);
}
