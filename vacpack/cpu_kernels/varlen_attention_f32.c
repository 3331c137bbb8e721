// Packed (variable-length) attention on float32, in plain C for any CPU: the float32 twin of
// varlen_attention.c (whose bf16 kernel needs AVX512-BF16), with the same arguments and the same
// layouts, so that one call serves corpus bins, encoders and whole engine steps.
//
// q, k and v are 1-D token streams: [tokens, heads, head_dim] with any token stride; sequence b
// owns query rows cu_q[b]..cu_q[b+1] and key rows cu_k[b]..cu_k[b+1]. Causal attention is
// aligned bottom-right: query i of a sequence with n_q queries and n_k keys sees keys
// 0..n_k-n_q+i (a fresh prefill, or a prefill chunk over cached keys). With page tables, keys
// and values are slots of a paged KV cache: key j of sequence b sits in slot
// pages[b][j / page_size] * page_size + j % page_size.
//
// One task is (sequence, KV head, chunk of queries). Its rows are the chunk's queries times the
// query heads that share the KV head, query-major, so that a block's rows see almost the same
// keys. The task copies the keys it can see into the layout a broadcast-and-FMA product reads
// (for each block of KEY_BLOCK keys, dim-major: the block's keys side by side for every dim),
// and notes where each value row lies. Then for each block of ROW_BLOCK rows: scores in
// registers (ROW_BLOCK rows by KEY_BLOCK keys of accumulators, one query element broadcast per
// FMA pair), already in log2 units (the queries are scaled by scale * log2 e when copied), a
// float32 softmax with a polynomial exp2, and the value product with the rows' output dims in
// registers while the value rows stream past from cache. Nothing of size [queries, keys] is
// written to memory: a block's scores live in a per-thread buffer.
//
// PyTorch's CPU paths either run this as batched matmuls over padded copies of each sequence,
// writing and re-reading the [queries, keys] matrices, or through its flash kernel, whose
// per-block softmax bookkeeping dominates at head sizes of 32 to 64.
//
// Written with eight-lane vectors (GCC's vector extension) and built with -O3 -march=native
// for the machine at hand (see build.py): AVX-512, AVX2 or NEON, whatever the CPU has. The
// register blocking (12 accumulators, two loaded vectors and a broadcast) fits the 16 vector
// registers of AVX2.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_store.h"
#include "varlen_tasks.h"
#include "vec8.h"

#define KEY_BLOCK 16  // keys per packed block: two vectors of eight
#define ROW_BLOCK 6   // query rows whose products share each loaded key or value vector
// Queries per task: a causal chunk sees only the keys up to its last query, so short chunks
// keep the work per task even; every bidirectional query sees all keys, and longer chunks pay
// for copying them once over more rows.
#define CAUSAL_QUERY_CHUNK 64
#define BIDIRECTIONAL_QUERY_CHUNK 256
#define LN2 0.6931471805599453f

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static const v8i LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7};

// Where row j of one KV head is: a row of the stream, or a slot of a paged cache. Rows are
// float32, or bfloat16 where a cache is kept in bfloat16 under float32 arithmetic: those are
// widened (a shift per value) as they are packed, so the products never see them.
typedef struct {
    const char* base;      // the KV head's first element of row 0 (or of slot 0)
    int64_t stride;        // bytes from one row (slot) to the next
    const int64_t* pages;  // NULL for stream rows; else this sequence's page table
    int64_t page_size;
    int is_bf16;           // bfloat16 elements, else float32
} KeyRows;

static inline const char* key_row(const KeyRows* rows, int64_t j) {
    if (!rows->pages) return rows->base + j * rows->stride;
    const int64_t page = rows->pages[j / rows->page_size];
    return rows->base + (page * rows->page_size + j % rows->page_size) * rows->stride;
}

// Elements d..d+7 of a row, as float32.
static inline v8f row_load8(const KeyRows* rows, const char* row, int64_t d) {
    return rows->is_bf16 ? load8_bf16((const bf16*)row + d) : load8((const float*)row + d);
}

static inline float row_element(const KeyRows* rows, const char* row, int64_t d) {
    return rows->is_bf16 ? bf16_to_float(((const bf16*)row)[d]) : ((const float*)row)[d];
}

// Asks for `bytes` bytes from `row` on into cache. Rows of a token stream or of a cache's
// pages lie a stride apart that the hardware prefetchers follow poorly (and stop at every
// page's end); a prefetch never faults, so one past the data is harmless.
static inline void prefetch_row(const void* row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char*)row + at);
}

// How many rows ahead of use rows read from memory are prefetched.
#define PREFETCH_ROWS 8

// keys[0..n) -> packed[block][dim][KEY_BLOCK], zero past n up to n_padded. Eight whole keys at
// a time are transposed in registers, eight dims at a time; a last partial group goes key by
// key.
static void pack_keys(const KeyRows* keys, int64_t n, int64_t n_padded, int64_t head_dim,
                      float* packed) {
    const int64_t element_bytes = keys->is_bf16 ? sizeof(bf16) : sizeof(float);
    for (int64_t first = 0; first < n_padded; first += 8) {
        float* dst = packed + (first / KEY_BLOCK) * head_dim * KEY_BLOCK + first % KEY_BLOCK;
        for (int64_t i = first + PREFETCH_ROWS; i < first + PREFETCH_ROWS + 8 && i < n; ++i)
            prefetch_row(key_row(keys, i), head_dim * element_bytes);
        if (first + 8 <= n) {
            const char* rows[8];
            for (int i = 0; i < 8; ++i) rows[i] = key_row(keys, first + i);
            for (int64_t d0 = 0; d0 < head_dim; d0 += 8) {
                v8f in[8], out[8];
                for (int i = 0; i < 8; ++i) in[i] = row_load8(keys, rows[i], d0);
                transpose8x8(in, out);
                for (int d = 0; d < 8; ++d) store8(dst + (d0 + d) * KEY_BLOCK, out[d]);
            }
            continue;
        }
        for (int64_t lane = 0; lane < 8; ++lane) {
            const int64_t key = first + lane;
            const char* src = key < n ? key_row(keys, key) : NULL;
            for (int64_t d = 0; d < head_dim; ++d)
                dst[d * KEY_BLOCK + lane] = src ? row_element(keys, src, d) : 0.0f;
        }
    }
}

// scores[r][0..n_padded) = q_r . key (q_r already scaled) for ROW_BLOCK rows of `queries`
// ([ROW_BLOCK][head_dim]); rows past the block repeat a real row and are never read back. Each
// row's largest score among its first visible[r] keys goes to maxima[r] (-inf where it sees
// none), taken from the accumulators as each block of keys is finished, so that the softmax
// needs no pass of its own to find it.
static void block_scores(const float* queries, const float* packed_keys, int64_t head_dim,
                         int64_t n_padded, const int64_t visible[ROW_BLOCK], float* scores,
                         int64_t stride, float maxima[ROW_BLOCK]) {
    v8f top[ROW_BLOCK];
    for (int r = 0; r < ROW_BLOCK; ++r) top[r] = (v8f){0} - INFINITY;
    for (int64_t block = 0; block < n_padded / KEY_BLOCK; ++block) {
        const float* keys = packed_keys + block * head_dim * KEY_BLOCK;
        v8f acc[ROW_BLOCK][2];
        for (int r = 0; r < ROW_BLOCK; ++r) acc[r][0] = acc[r][1] = (v8f){0};
        for (int64_t d = 0; d < head_dim; ++d) {
            const v8f k0 = load8(keys + d * KEY_BLOCK);
            const v8f k1 = load8(keys + d * KEY_BLOCK + 8);
#pragma GCC unroll 6
            for (int r = 0; r < ROW_BLOCK; ++r) {
                const v8f q = splat8(queries[r * head_dim + d]);
                acc[r][0] += q * k0;
                acc[r][1] += q * k1;
            }
        }
        const int64_t first_key = block * KEY_BLOCK;
        for (int r = 0; r < ROW_BLOCK; ++r) {
            store8(scores + r * stride + first_key, acc[r][0]);
            store8(scores + r * stride + first_key + 8, acc[r][1]);
            if (first_key + KEY_BLOCK <= visible[r]) {
                top[r] = select8(acc[r][0] > top[r], acc[r][0], top[r]);
                top[r] = select8(acc[r][1] > top[r], acc[r][1], top[r]);
            } else if (first_key < visible[r]) {  // the keys past the row's last are left out
                const v8i seen = (v8i){0} + (int32_t)(visible[r] - first_key);
                top[r] = select8((acc[r][0] > top[r]) & (LANE_INDEX < seen), acc[r][0], top[r]);
                top[r] = select8((acc[r][1] > top[r]) & (LANE_INDEX + 8 < seen), acc[r][1],
                                 top[r]);
            }
        }
    }
    for (int r = 0; r < ROW_BLOCK; ++r) {
        float max = top[r][0];
        for (int lane = 1; lane < 8; ++lane) max = top[r][lane] > max ? top[r][lane] : max;
        maxima[r] = max;
    }
}

// Softmax of one row over its first `visible` scores (log2 units), whose largest is max_log2,
// in place as weights 2^(score - max), zero from `visible` up to n_padded. Returns the weights'
// sum.
static float row_softmax(float* scores, int64_t visible, int64_t n_padded, float max_log2) {
    v8f total = {0};
    int64_t j = 0;
    for (; j + 8 <= visible; j += 8) {
        const v8f weights = exp2_nonpositive8(load8(scores + j) - max_log2);
        store8(scores + j, weights);
        total += weights;
    }
    if (j < visible) {
        const v8i inside = LANE_INDEX < (v8i){0} + (int32_t)(visible - j);
        const v8f weights =
            select8(inside, exp2_nonpositive8(load8(scores + j) - max_log2), (v8f){0});
        store8(scores + j, weights);
        total += weights;
        j += 8;
    }
    for (; j < n_padded; j += 8) store8(scores + j, (v8f){0});
    return ((total[0] + total[4]) + (total[1] + total[5])) +
           ((total[2] + total[6]) + (total[3] + total[7]));
}

// values[0..n) -> packed[chunk][key][16]: each 16-dim chunk of every key's row side by side
// (the last chunk 8 wide where head_dim is an odd multiple of 8), so that the value product
// streams each chunk from one run of memory. Read in place, rows a cache's or a token
// stream's stride apart (1.5 KiB for MiniLM's 12 heads) fall into a few L1 sets and evict each
// other between the product's passes.
static void pack_values(const KeyRows* values, int64_t n, int64_t head_dim, float* packed) {
    const int64_t row_bytes = head_dim * (values->is_bf16 ? sizeof(bf16) : sizeof(float));
    for (int64_t j = 0; j < n; ++j) {
        if (j + PREFETCH_ROWS < n) prefetch_row(key_row(values, j + PREFETCH_ROWS), row_bytes);
        const char* row = key_row(values, j);
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
            const int64_t width = head_dim - d0 >= 16 ? 16 : 8;
            float* dst = packed + d0 * n + j * width;
            store8(dst, row_load8(values, row, d0));
            if (width == 16) store8(dst + 8, row_load8(values, row, d0 + 8));
        }
    }
}

// acc_r = sum_j weights_r[j] * chunk_j for ROW_BLOCK rows over one packed chunk of 8 * VECTORS
// dims. Always inlined with a constant VECTORS (two, or one for a head_dim's last eight dims).
static inline __attribute__((always_inline)) void accumulate_values(
    const float* weights, int64_t stride, const float* chunk, int64_t n_seen,
    v8f acc[ROW_BLOCK][2], const int vectors) {
    for (int r = 0; r < ROW_BLOCK; ++r) acc[r][0] = acc[r][1] = (v8f){0};
    for (int64_t j = 0; j < n_seen; ++j) {
        const v8f v0 = load8(chunk + j * 8 * vectors);
        const v8f v1 = vectors == 2 ? load8(chunk + j * 16 + 8) : (v8f){0};
#pragma GCC unroll 6
        for (int r = 0; r < ROW_BLOCK; ++r) {
            const v8f w = splat8(weights[r * stride + j]);
            acc[r][0] += w * v0;
            if (vectors == 2) acc[r][1] += w * v1;
        }
    }
}

// out_r = (weights_r . values) / sums_r for ROW_BLOCK rows, num_rows of them written; values
// packed by pack_values for n_packed keys, of which the first n_seen are read.
static void block_values(const float* weights, int64_t stride, const float* sums,
                         const float* values, int64_t n_packed, int64_t n_seen,
                         int64_t head_dim, float* const out_rows[ROW_BLOCK], int num_rows) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
        const int vectors = head_dim - d0 >= 16 ? 2 : 1;
        const float* chunk = values + d0 * n_packed;
        v8f acc[ROW_BLOCK][2];
        if (vectors == 2)
            accumulate_values(weights, stride, chunk, n_seen, acc, 2);
        else
            accumulate_values(weights, stride, chunk, n_seen, acc, 1);
        for (int r = 0; r < num_rows; ++r) {
            // A row that sees no key (an empty bidirectional sequence) gets zeros.
            const float inverse = sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f;
            store8(out_rows[r] + d0, acc[r][0] * inverse);
            if (vectors == 2) store8(out_rows[r] + d0 + 8, acc[r][1] * inverse);
        }
    }
}

// Returns 0, -1 when a buffer could not be allocated or head_dim is not a multiple of 8, or -2
// when a new key's slot lies outside the cache. With page_tables NULL, keys and values of
// sequence b are rows cu_k[b].. of k and v; else k and v are the cache's slots and
// page_tables[b * pages_stride ..] is b's page table (cu_k still gives the key counts), and the
// call first stores num_new new keys and values (rows new_k_stride and new_v_stride elements
// apart, in the cache's dtype) to slots new_slots (kv_store.h). With lse not NULL, each row's
// log-sum-exp of its scaled scores goes to lse[token * num_heads + head], for merging with
// attention over other keys. kv_bf16: k and v hold bfloat16 (strides still in elements), else
// float32 like q and out.
int varlen_attention_f32(VARLEN_ATTENTION_PARAMS(float, void)) {
    // Keys packed for the bf16 kernels' products (varlen_tasks.h) are not read here.
    if (head_dim % 8 || keys_packed) return -1;
    const NewKV new_kv = {new_k, new_v, new_slots, num_new, new_k_stride, new_v_stride, num_slots};
    if (!new_kv_fits(&new_kv)) return -2;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t query_chunk = causal ? CAUSAL_QUERY_CHUNK : BIDIRECTIONAL_QUERY_CHUNK;
    int64_t num_tasks, max_keys;
    Task* tasks =
        build_tasks(cu_q, cu_k, num_seqs, num_kv_heads, query_chunk, &num_tasks, &max_keys);
    if (!tasks) return -1;
    const int64_t max_padded = round_up(max_keys > 0 ? max_keys : 1, KEY_BLOCK);
    const float log2_scale = scale * LOG2E;
    const int64_t kv_bytes = kv_bf16 ? sizeof(bf16) : sizeof(float);
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        store_new_kv(&new_kv, k, v, k_stride, v_stride, num_kv_heads, head_dim, page_size, 0,
                     kv_bytes);
        float* keys = aligned_alloc(64, round_up(max_padded * head_dim * 4, 64));
        float* values = aligned_alloc(64, round_up(max_padded * head_dim * 4, 64));
        float* scores = aligned_alloc(64, round_up(ROW_BLOCK * max_padded * 4, 64));
        float* queries = aligned_alloc(64, round_up(ROW_BLOCK * head_dim * 4, 64));
        const int allocated = keys && values && scores && queries;
        if (!allocated) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; ++i) {
            if (!allocated) continue;  // reported through `failed`
            const Task task = tasks[i];
            const TaskKeys seen = task_keys(task, cu_q, cu_k, page_tables, pages_stride, causal);
            const int64_t n_k = seen.n_k, n_seen = seen.n_seen;
            const int64_t first_position = seen.first_position;  // of query 0, when causal
            const int64_t* pages = seen.pages;
            const int64_t first_row = seen.first_row;
            const KeyRows key_rows = {
                (const char*)k + (first_row * k_stride + task.kv_head * head_dim) * kv_bytes,
                k_stride * kv_bytes, pages, page_size, kv_bf16};
            const KeyRows value_source = {
                (const char*)v + (first_row * v_stride + task.kv_head * head_dim) * kv_bytes,
                v_stride * kv_bytes, pages, page_size, kv_bf16};
            pack_keys(&key_rows, n_seen, round_up(n_seen, KEY_BLOCK), head_dim, keys);
            pack_values(&value_source, n_seen, head_dim, values);
            // Rows: (query, head of the group), query-major.
            const int64_t num_task_rows = (task.query_end - task.query_start) * group;
            for (int64_t r0 = 0; r0 < num_task_rows; r0 += ROW_BLOCK) {
                const int num_rows =
                    (int)(num_task_rows - r0 < ROW_BLOCK ? num_task_rows - r0 : ROW_BLOCK);
                float* out_rows[ROW_BLOCK];
                int64_t visible[ROW_BLOCK], lse_index[ROW_BLOCK];
                float sums[ROW_BLOCK], maxima[ROW_BLOCK];
                for (int r = 0; r < ROW_BLOCK; ++r) {
                    // Rows past the block's end repeat its first row and are never written.
                    const int64_t row = r0 + (r < num_rows ? r : 0);
                    const int64_t query = task.query_start + row / group;
                    const int64_t head = task.kv_head * group + row % group;
                    const int64_t token = cu_q[task.seq] + query;
                    const float* q_row = q + token * q_stride + head * head_dim;
                    for (int64_t d = 0; d < head_dim; ++d)
                        queries[r * head_dim + d] = q_row[d] * log2_scale;
                    // The next block's query row, read after this block's products.
                    const int64_t ahead = row + ROW_BLOCK;
                    if (ahead < num_task_rows) {
                        const int64_t ahead_token = cu_q[task.seq] + task.query_start + ahead / group;
                        prefetch_row(q + ahead_token * q_stride +
                                         (task.kv_head * group + ahead % group) * head_dim,
                                     head_dim * sizeof(float));
                    }
                    out_rows[r] = out + token * out_stride + head * head_dim;
                    lse_index[r] = token * num_heads + head;
                    visible[r] = causal ? first_position + query + 1 : n_k;
                }
                // Query-major rows: the block's last row sees the most keys.
                const int64_t block_seen = visible[num_rows - 1];
                const int64_t block_padded = round_up(block_seen, KEY_BLOCK);
                block_scores(queries, keys, head_dim, block_padded, visible, scores, max_padded,
                             maxima);
                for (int r = 0; r < ROW_BLOCK; ++r)
                    sums[r] = row_softmax(scores + r * max_padded, visible[r], block_padded,
                                          maxima[r]);
                if (lse)
                    for (int r = 0; r < num_rows; ++r)
                        lse[lse_index[r]] =
                            sums[r] > 0.0f ? (maxima[r] + log2f(sums[r])) * LN2 : -INFINITY;
                block_values(scores, max_padded, sums, values, n_seen, block_seen, head_dim,
                             out_rows, num_rows);
            }
        }
        free(keys);
        free(values);
        free(scores);
        free(queries);
    }
    free(tasks);
    return failed ? -1 : 0;
}
