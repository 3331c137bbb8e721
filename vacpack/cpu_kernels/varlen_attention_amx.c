// Packed (variable-length) attention on bf16 with AMX tiles, for x86 CPUs that have them
// (Intel Sapphire Rapids on). The same call, tasks and layouts as varlen_attention.c, whose
// header describes them; here both products run on the tiles (tiles.h), the rest (packing,
// softmax, normalising) in plain C over GCC's vector types (16 float32 lanes for the softmax,
// vec8.h's 8-lane transposes for packing keys).
//
// A task packs the keys it can see into the tiles' B layout, which is also
// varlen_attention.c's ([key block of 16][dim pair][16 keys][2 dims]), and its values into
// [key pair][dim][2 keys]. Then per block of 16 rows (a tile's rows): the rows' queries are
// copied side by side (a tile loads rows at one stride, and a block's rows are (query, head)
// pairs), scores for 32 keys at a time go from two float32 tiles to a buffer, a float32
// softmax with a polynomial exp2 writes bf16 probabilities, and the value product accumulates
// 64 output dims at a time in four float32 tiles over 32 keys per step.
//
// Rows past a block's last real row repeat its first and are never written. The scores of keys
// past a row's last visible one are computed (a block's rows share their keys) and dropped by
// the softmax, which writes zero probabilities for them.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_store.h"
#include "tiles.h"
#include "varlen_tasks.h"
#include "vec16.h"
#include "vec8.h"

#define KEY_BLOCK 16      // keys per B tile of the score product (its columns)
#define KEYS_PER_STEP 32  // keys per step of either product: two score tiles, one value step
#define DIMS_PER_STEP 32  // head dims per step of the score product (a tile row of bf16 pairs)
#define VALUE_TILES 4     // float32 tiles of 16 output dims each accumulating at once
// Queries per task: each task packs the keys its queries see, which the products on tiles hide
// less well than those on AVX-512 registers, so tasks are twice as long as varlen_attention.c's
// (half the packing; still 16 tasks for two 1,024-token prefills on 2 KV heads).
#define QUERY_CHUNK 128
#define LN2 0.6931471805599453f

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// keys[0..n) -> packed[key block][dim pair][16 keys][2 dims], zero up to n_padded. A block of
// 16 keys in one run of rows (stream rows, or one page) is transposed in registers, 8 keys by 8
// pairs at a time (a pair's bits moved as a float32 lane, never computed on); the others (the
// last, partial block; blocks across pages) go a key at a time.
static void pack_keys(const Bf16Rows* keys, int64_t n, int64_t num_pairs, int64_t n_padded,
                      uint32_t* packed) {
    for (int64_t block = 0; block < n_padded / KEY_BLOCK; ++block) {
        uint32_t* dst = packed + block * num_pairs * KEY_BLOCK;
        const int64_t first = block * KEY_BLOCK;
        const int one_run =
            !keys->pages || first % keys->page_size + KEY_BLOCK <= keys->page_size;
        if (first + KEY_BLOCK <= n && one_run) {
            const bf16* src = bf16_row(keys, first);
            for (int64_t half = 0; half < KEY_BLOCK; half += 8)
                for (int64_t pair0 = 0; pair0 < num_pairs; pair0 += 8) {
                    v8f rows[8], columns[8];
                    for (int i = 0; i < 8; ++i)
                        memcpy(&rows[i], src + (half + i) * keys->stride + 2 * pair0, 32);
                    transpose8x8(rows, columns);
                    for (int j = 0; j < 8; ++j)
                        memcpy(dst + (pair0 + j) * KEY_BLOCK + half, &columns[j], 32);
                }
            continue;
        }
        for (int64_t lane = 0; lane < KEY_BLOCK; ++lane) {
            const int64_t key = first + lane;
            const bf16* src = key < n ? bf16_row(keys, key) : NULL;
            for (int64_t pair = 0; pair < num_pairs; ++pair) {
                uint32_t bits = 0;
                if (src) memcpy(&bits, src + 2 * pair, sizeof(bits));
                dst[pair * KEY_BLOCK + lane] = bits;
            }
        }
    }
}

// The same from a cache that keeps its keys packed (`blocks`, rows of 16 keys): whole blocks
// copied, the last partial one a key at a time, zero up to n_padded.
static void copy_key_blocks(const Bf16Rows* blocks, int64_t n, int64_t num_pairs,
                            int64_t n_padded, uint32_t* packed) {
    for (int64_t block = 0; block < n_padded / KEY_BLOCK; ++block) {
        uint32_t* dst = packed + block * num_pairs * KEY_BLOCK;
        const int64_t first = block * KEY_BLOCK;
        if (first >= n) {  // past the sequence's pages: nothing to read
            memset(dst, 0, num_pairs * KEY_BLOCK * sizeof(uint32_t));
            continue;
        }
        const uint32_t* src = (const uint32_t*)bf16_row(blocks, block);
        if (first + KEY_BLOCK <= n) {
            memcpy(dst, src, num_pairs * KEY_BLOCK * sizeof(uint32_t));
            continue;
        }
        for (int64_t pair = 0; pair < num_pairs; ++pair)
            for (int64_t lane = 0; lane < KEY_BLOCK; ++lane)
                dst[pair * KEY_BLOCK + lane] =
                    first + lane < n ? src[pair * KEY_BLOCK + lane] : 0;
    }
}

// values[0..n) -> packed[key pair][dim][2 keys], zero up to n_padded.
static void pack_values(const Bf16Rows* values, int64_t n, int64_t head_dim, int64_t n_padded,
                        bf16* packed) {
    for (int64_t pair = 0; pair < n_padded / 2; ++pair) {
        const int64_t first = 2 * pair;
        interleave_rows(first < n ? bf16_row(values, first) : NULL,
                        first + 1 < n ? bf16_row(values, first + 1) : NULL, head_dim,
                        packed + pair * head_dim * 2);
    }
}

// scores[r][0..n_padded) = query_r . key for the block's 16 rows (queries[r] at head_dim apart).
static void block_scores(const bf16* queries, const uint32_t* packed_keys, int64_t head_dim,
                         int64_t n_padded, float* scores, int64_t scores_stride) {
    const int64_t num_pairs = head_dim / 2;
    for (int64_t block = 0; block < n_padded / KEY_BLOCK; block += 2) {
        const uint32_t* first = packed_keys + block * num_pairs * KEY_BLOCK;
        const uint32_t* second = first + num_pairs * KEY_BLOCK;
        TILE_ZERO(0);
        TILE_ZERO(1);
        for (int64_t d0 = 0; d0 < head_dim; d0 += DIMS_PER_STEP) {
            const int64_t pair0 = d0 / 2;  // the step's first dim pair: its B tile's row 0
            TILE_LOAD(2, queries + d0, head_dim * sizeof(bf16));
            TILE_LOAD(3, first + pair0 * KEY_BLOCK, KEY_BLOCK * sizeof(uint32_t));
            TILE_LOAD(4, second + pair0 * KEY_BLOCK, KEY_BLOCK * sizeof(uint32_t));
            TILE_DOT(0, 2, 3);
            TILE_DOT(1, 2, 4);
        }
        TILE_STORE(0, scores + block * KEY_BLOCK, scores_stride * sizeof(float));
        TILE_STORE(1, scores + (block + 1) * KEY_BLOCK, scores_stride * sizeof(float));
    }
}

// Softmax of one row over its first `visible` scores, written as bf16 probabilities up to
// n_padded (a multiple of 16; zeros past `visible`); returns the float32 sum of the
// probabilities and sets max_log2 to the largest scaled score, in log2 units.
static float row_softmax(const float* scores, int64_t visible, int64_t n_padded,
                         float log2_scale, bf16* probs, float* max_log2) {
    const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16f most = (v16f){0} - INFINITY;
    for (int64_t j = 0; j < visible; j += 16) {
        const v16f s = load16(scores + j);
        const v16i take = (lanes + (int32_t)j < (int32_t)visible) & (s > most);
        most = (v16f)(((v16i)s & take) | ((v16i)most & ~take));
    }
    float largest = most[0];
    for (int i = 1; i < 16; ++i) largest = most[i] > largest ? most[i] : largest;
    *max_log2 = largest * log2_scale;
    v16f sum = {0};
    int64_t j = 0;
    for (; j < visible; j += 16) {
        const v16f x = load16(scores + j) * log2_scale - *max_log2;
        const v16i seen = lanes + (int32_t)j < (int32_t)visible;
        const v16f p = (v16f)((v16i)EXP2_NONPOSITIVE(v16f, v16i, x) & seen);
        sum += p;
        store16_bf16(probs + j, p);
    }
    for (; j < n_padded; j += 16) memset(probs + j, 0, 16 * sizeof(bf16));
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += sum[i];
    return total;
}

// out[r][0..head_dim) = probs_r . values over n_padded keys, float32, for the block's 16 rows.
static void block_values(const bf16* probs, int64_t probs_stride, const bf16* packed_values,
                         int64_t head_dim, int64_t n_padded, float* out) {
    const int64_t value_stride = head_dim * 2 * sizeof(bf16);  // one key pair's row
    for (int64_t d0 = 0; d0 < head_dim; d0 += VALUE_TILES * 16) {
        // head_dim is a multiple of 32: the last pass has 2 or 4 tiles.
        const int num_tiles = head_dim - d0 >= VALUE_TILES * 16 ? VALUE_TILES : 2;
        TILE_ZERO(4);
        TILE_ZERO(5);
        if (num_tiles > 2) {
            TILE_ZERO(6);
            TILE_ZERO(7);
        }
        for (int64_t k0 = 0; k0 < n_padded; k0 += KEYS_PER_STEP) {
            const bf16* step = packed_values + (k0 / 2) * head_dim * 2 + d0 * 2;
            TILE_LOAD(0, probs + k0, probs_stride * sizeof(bf16));
            TILE_LOAD(1, step, value_stride);
            TILE_DOT(4, 0, 1);
            TILE_LOAD(1, step + 16 * 2, value_stride);
            TILE_DOT(5, 0, 1);
            if (num_tiles > 2) {
                TILE_LOAD(1, step + 32 * 2, value_stride);
                TILE_DOT(6, 0, 1);
                TILE_LOAD(1, step + 48 * 2, value_stride);
                TILE_DOT(7, 0, 1);
            }
        }
        const int64_t out_stride = head_dim * sizeof(float);
        TILE_STORE(4, out + d0, out_stride);
        TILE_STORE(5, out + d0 + 16, out_stride);
        if (num_tiles > 2) {
            TILE_STORE(6, out + d0 + 32, out_stride);
            TILE_STORE(7, out + d0 + 48, out_stride);
        }
    }
}

// 0 once the process may use the tiles (Linux grants their state on request), else minus
// the request's errno: call before varlen_attention_amx.
int varlen_attention_amx_ready(void) { return tiles_request_permission(); }

// The arguments and result of varlen_attention_bf16 (varlen_attention.c).
int varlen_attention_amx(VARLEN_ATTENTION_PARAMS(bf16, bf16)) {
    if (!kv_bf16 || head_dim % DIMS_PER_STEP) return -1;
    if (keys_packed && (!page_tables || page_size % KEYS_PER_PACKED_BLOCK)) return -1;
    const NewKV new_kv = {new_k, new_v, new_slots, num_new, new_k_stride, new_v_stride, num_slots};
    if (!new_kv_fits(&new_kv)) return -2;
    const int64_t group = num_heads / num_kv_heads;
    int64_t num_tasks, max_keys;
    Task* tasks =
        build_tasks(cu_q, cu_k, num_seqs, num_kv_heads, QUERY_CHUNK, &num_tasks, &max_keys);
    if (!tasks) return -1;
    const int64_t max_padded = round_up(max_keys > 0 ? max_keys : 1, KEYS_PER_STEP);
    const float log2_scale = scale * LOG2E;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        store_new_kv(&new_kv, k, v, k_stride, v_stride, num_kv_heads, head_dim, page_size,
                     keys_packed, sizeof(bf16));
        const size_t kv_bytes = round_up(max_padded * head_dim * sizeof(bf16), 64);
        uint32_t* keys = aligned_alloc(64, kv_bytes);
        bf16* values = aligned_alloc(64, kv_bytes);
        bf16* queries = aligned_alloc(64, round_up(TILE_ROWS * head_dim * sizeof(bf16), 64));
        float* scores = aligned_alloc(64, round_up(TILE_ROWS * max_padded * sizeof(float), 64));
        bf16* probs = aligned_alloc(64, round_up(TILE_ROWS * max_padded * sizeof(bf16), 64));
        float* block_out = aligned_alloc(64, round_up(TILE_ROWS * head_dim * sizeof(float), 64));
        const int allocated = keys && values && queries && scores && probs && block_out;
        if (!allocated) {
#pragma omp atomic write
            failed = 1;
        } else {
            tiles_configure();
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; ++i) {
            if (!allocated) continue;  // reported through `failed`
            const Task task = tasks[i];
            const TaskKeys seen = task_keys(task, cu_q, cu_k, page_tables, pages_stride, causal);
            const Bf16Rows value_rows = slot_rows(v, seen.first_row, v_stride, task.kv_head,
                                                  head_dim, seen.pages, page_size);
            const int64_t task_padded = round_up(seen.n_seen, KEYS_PER_STEP);
            if (keys_packed) {
                const Bf16Rows blocks = packed_key_blocks(k, task.kv_head, num_kv_heads,
                                                          head_dim, seen.pages, page_size);
                copy_key_blocks(&blocks, seen.n_seen, head_dim / 2, task_padded, keys);
            } else {
                const Bf16Rows key_rows = slot_rows(k, seen.first_row, k_stride, task.kv_head,
                                                    head_dim, seen.pages, page_size);
                pack_keys(&key_rows, seen.n_seen, head_dim / 2, task_padded, keys);
            }
            pack_values(&value_rows, seen.n_seen, head_dim, task_padded, values);
            // Rows: (query, head of the group), query-major.
            const int64_t num_task_rows = (task.query_end - task.query_start) * group;
            for (int64_t r0 = 0; r0 < num_task_rows; r0 += TILE_ROWS) {
                const int num_rows =
                    (int)(num_task_rows - r0 < TILE_ROWS ? num_task_rows - r0 : TILE_ROWS);
                int64_t tokens[TILE_ROWS], heads[TILE_ROWS], visible[TILE_ROWS];
                for (int r = 0; r < TILE_ROWS; ++r) {
                    const int64_t row = r0 + (r < num_rows ? r : 0);
                    const int64_t query = task.query_start + row / group;
                    tokens[r] = cu_q[task.seq] + query;
                    heads[r] = task.kv_head * group + row % group;
                    visible[r] = causal ? seen.first_position + query + 1 : seen.n_k;
                    memcpy(queries + r * head_dim, q + tokens[r] * q_stride + heads[r] * head_dim,
                           head_dim * sizeof(bf16));
                }
                // Query-major rows: the block's last real row sees the most keys.
                const int64_t block_padded = round_up(visible[num_rows - 1], KEYS_PER_STEP);
                block_scores(queries, keys, head_dim, block_padded, scores, max_padded);
                float sums[TILE_ROWS], maxima[TILE_ROWS];
                for (int r = 0; r < TILE_ROWS; ++r)
                    sums[r] = row_softmax(scores + r * max_padded, visible[r], block_padded,
                                          log2_scale, probs + r * max_padded, &maxima[r]);
                block_values(probs, max_padded, values, head_dim, block_padded, block_out);
                for (int r = 0; r < num_rows; ++r) {
                    const float inverse = 1.0f / sums[r];
                    bf16* dst = out + tokens[r] * out_stride + heads[r] * head_dim;
                    for (int64_t d = 0; d < head_dim; d += 16)
                        store16_bf16(dst + d, load16(block_out + r * head_dim + d) * inverse);
                    if (lse)
                        lse[tokens[r] * num_heads + heads[r]] = (maxima[r] + log2f(sums[r])) * LN2;
                }
            }
        }
        if (allocated) tiles_release();
        free(keys);
        free(values);
        free(queries);
        free(scores);
        free(probs);
        free(block_out);
    }
    free(tasks);
    return failed ? -1 : 0;
}
