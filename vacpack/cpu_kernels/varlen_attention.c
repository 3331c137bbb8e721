// Packed (variable-length) attention on bf16 for x86 CPUs with AVX512-BF16.
//
// q, k and v are 1-D token streams: [tokens, heads, head_dim] with any token stride; sequence b
// owns query rows cu_q[b]..cu_q[b+1] and key rows cu_k[b]..cu_k[b+1]. No padding exists anywhere:
// each sequence attends only to its own keys. Causal attention is aligned bottom-right: query i
// of a sequence with n_q queries and n_k keys sees keys 0..n_k-n_q+i, so the same call serves a
// fresh prefill (n_k == n_q) and a prefill chunk over cached keys (n_k > n_q).
//
// Keys and values are either rows of the stream (cu_k gives each sequence's first row) or slots
// of a paged KV cache: with page tables, key j of sequence b sits in slot
// pages[b][j / page_size] * page_size + j % page_size. One call then serves a whole engine
// step: decodes (one query each), fresh prefills and prefill chunks over their cached pages.
// A cache may keep its keys packed (varlen_tasks.h): then the products read them in place.
//
// One task is (sequence, KV head, chunk of queries). Its rows are the chunk's queries times the
// query heads that share the KV head, query-major, so that a decode's grouped heads fill a row
// block together and a block's rows see almost the same keys. Tasks run largest first, by size
// class (varlen_tasks.h, order_by_work). The task packs the keys it can see into the layout
// VDPBF16PS wants (pairs of dims of 16 keys side by side; from a cache that keeps its keys
// packed, it reads them in place), then for each block of ROW_BLOCK rows: scores
// in float32 registers, a float32 softmax with a polynomial exp2, probabilities rounded to
// bf16 as in flash-attention kernels, and the value product with the same instruction,
// interleaving pairs of value rows on the fly. A block's scores live in a per-thread buffer, so
// no [queries, keys] matrix is ever written to memory. Where a call has too few tasks for the
// threads (a few long decodes), each decode's keys are split over several tasks whose partial
// results merge by their log-sum-exps (split-K, varlen_tasks.h).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp2_avx512.h"
#include "kv_store.h"
#include "varlen_tasks.h"

#define KEY_BLOCK 16
#define ROW_BLOCK 8
#define QUERY_CHUNK 64
// Value pairs between two shares of the next task's prefetch (4 to 16 measured alike).
#define VALUE_RUN 8
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef uint16_t bf16;

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static inline __m512bh broadcast_pair(const bf16* pair) {
    int32_t bits;
    memcpy(&bits, pair, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
}

static inline __m512bh load_bh(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Transposes a 16x16 matrix of 32-bit elements (rows in r, columns out), in four rounds of
// shuffles: 32-bit and 64-bit unpacks within 128-bit lanes, then two rounds across lanes.
static inline void transpose_16x16(const __m512i r[16], __m512i out[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4m + c], 128-bit lane L: column 4L + c of rows 4m..4m+3.
    for (int m = 0; m < 4; ++m) {
        u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i even_top = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        const __m512i odd_top = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i even_bottom = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i odd_bottom = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        out[c] = _mm512_shuffle_i32x4(even_top, even_bottom, 0x88);
        out[8 + c] = _mm512_shuffle_i32x4(even_top, even_bottom, 0xdd);
        out[4 + c] = _mm512_shuffle_i32x4(odd_top, odd_bottom, 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(odd_top, odd_bottom, 0xdd);
    }
}

// A task's keys or values (rows 0..n of `row_bytes` each) requested into L2 a share at a time
// while another task computes: `done` rows requested so far.
typedef struct {
    Bf16Rows rows;
    int64_t n, row_bytes, done;
} Prefetch;

static const Prefetch NO_PREFETCH = {{0, 0, 0, 1, 0}, 0, 0, 0};

// Requests the rows up to `upto` (clamped to n) that are not requested yet. A prefetch never
// faults, so the bytes past a row's head in its slot are harmless.
static inline void prefetch_to(Prefetch* run, int64_t upto) {
    if (upto > run->n) upto = run->n;
    for (; run->done < upto; ++run->done) {
        const char* row = (const char*)bf16_row(&run->rows, run->done);
        for (int64_t line = 0; line < run->row_bytes; line += 64)
            _mm_prefetch(row + line, _MM_HINT_T1);
    }
}

// keys[0..n) -> packed[key_block][dim_pair][16 keys][2 dims], zero past n. A block of 16 keys
// in one run of rows (stream rows, or one page) is transposed in registers, 16 pairs of dims
// at a time; the others (the last, partial block; blocks across pages) go a pair at a time.
// Each block also requests its share of `ahead` (the next task's keys).
static void pack_keys(const Bf16Rows* keys, int64_t n, int64_t num_pairs, int64_t n_padded,
                      bf16* packed, Prefetch* ahead) {
    const int64_t num_blocks = n_padded / KEY_BLOCK;
    for (int64_t block = 0; block < num_blocks; ++block) {
        prefetch_to(ahead, (block + 1) * ahead->n / num_blocks);
        uint32_t* dst = (uint32_t*)(packed + block * num_pairs * 2 * KEY_BLOCK);
        const int64_t first = block * KEY_BLOCK;
        const int one_run =
            !keys->pages || first % keys->page_size + KEY_BLOCK <= keys->page_size;
        if (first + KEY_BLOCK <= n && one_run) {
            const bf16* src = bf16_row(keys, first);
            for (int64_t tile = 0; tile < num_pairs / 16; ++tile) {
                __m512i rows[16], columns[16];
                for (int i = 0; i < 16; ++i)
                    rows[i] = _mm512_loadu_si512(src + i * keys->stride + tile * 32);
                transpose_16x16(rows, columns);
                for (int j = 0; j < 16; ++j)
                    _mm512_storeu_si512(dst + (tile * 16 + j) * KEY_BLOCK, columns[j]);
            }
            continue;
        }
        for (int64_t lane = 0; lane < KEY_BLOCK; ++lane) {
            const int64_t key = first + lane;
            if (key < n) {
                const bf16* src = bf16_row(keys, key);
                for (int64_t pair = 0; pair < num_pairs; ++pair) {
                    uint32_t bits;
                    memcpy(&bits, src + 2 * pair, sizeof(bits));
                    dst[pair * KEY_BLOCK + lane] = bits;
                }
            } else {
                for (int64_t pair = 0; pair < num_pairs; ++pair) dst[pair * KEY_BLOCK + lane] = 0;
            }
        }
    }
}

// scores[r][0..16 num_blocks) = q_r . key for ROW_BLOCK rows (rows past the block repeat a real
// row and are never read back), from the packed key blocks `blocks` (rows of 16 keys). Each pair
// of blocks requests its share of `ahead` (the next task's keys, when not requested yet).
static void block_scores(const bf16* const rows[ROW_BLOCK], const Bf16Rows* blocks,
                         int64_t num_pairs, int64_t num_blocks, float* scores, int64_t stride,
                         Prefetch* ahead) {
    int64_t block = 0;
    for (; block + 1 < num_blocks; block += 2) {
        prefetch_to(ahead, (block + 2) * ahead->n / num_blocks);
        __m512 acc0[ROW_BLOCK], acc1[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
        const bf16* k0 = bf16_row(blocks, block);
        const bf16* k1 = bf16_row(blocks, block + 1);
        for (int64_t pair = 0; pair < num_pairs; ++pair) {
            const __m512bh keys0 = load_bh(k0 + pair * 2 * KEY_BLOCK);
            const __m512bh keys1 = load_bh(k1 + pair * 2 * KEY_BLOCK);
#pragma GCC unroll 8
            for (int r = 0; r < ROW_BLOCK; ++r) {
                const __m512bh q = broadcast_pair(rows[r] + 2 * pair);
                acc0[r] = _mm512_dpbf16_ps(acc0[r], q, keys0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], q, keys1);
            }
        }
        for (int r = 0; r < ROW_BLOCK; ++r) {
            _mm512_storeu_ps(scores + r * stride + block * KEY_BLOCK, acc0[r]);
            _mm512_storeu_ps(scores + r * stride + (block + 1) * KEY_BLOCK, acc1[r]);
        }
    }
    for (; block < num_blocks; ++block) {
        prefetch_to(ahead, ahead->n);
        __m512 acc[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; ++r) acc[r] = _mm512_setzero_ps();
        const bf16* k0 = bf16_row(blocks, block);
        for (int64_t pair = 0; pair < num_pairs; ++pair) {
            const __m512bh keys0 = load_bh(k0 + pair * 2 * KEY_BLOCK);
#pragma GCC unroll 8
            for (int r = 0; r < ROW_BLOCK; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], broadcast_pair(rows[r] + 2 * pair), keys0);
        }
        for (int r = 0; r < ROW_BLOCK; ++r)
            _mm512_storeu_ps(scores + r * stride + block * KEY_BLOCK, acc[r]);
    }
}

// Softmax of one row over its first `visible` scores, written as bf16 probabilities up to
// n_padded (zeros past `visible`); returns the float32 sum of the probabilities and sets
// max_log2 to the largest scaled score, in log2 units.
static float row_softmax(const float* scores, int64_t visible, int64_t n_padded, float log2_scale,
                         bf16* probs, float* max_log2) {
    __m512 max_vec = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n_padded; j += KEY_BLOCK) {
        const int64_t left = visible - j;
        if (left <= 0) break;
        const __mmask16 mask = left >= KEY_BLOCK ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        max_vec = _mm512_mask_max_ps(max_vec, mask, max_vec, _mm512_loadu_ps(scores + j));
    }
    *max_log2 = _mm512_reduce_max_ps(max_vec) * log2_scale;
    const __m512 offset = _mm512_set1_ps(*max_log2);
    const __m512 factor = _mm512_set1_ps(log2_scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_padded; j += KEY_BLOCK) {
        const int64_t left = visible - j;
        const __mmask16 mask = left >= KEY_BLOCK ? (__mmask16)0xFFFF
                               : left <= 0       ? (__mmask16)0
                                                 : (__mmask16)((1u << left) - 1);
        __m512 p = _mm512_setzero_ps();
        if (mask) {
            const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j), factor, offset);
            p = _mm512_maskz_mov_ps(mask, exp2_nonpositive(x));
        }
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i*)(probs + j), (__m256i)_mm512_cvtneps_pbh(p));
    }
    return _mm512_reduce_add_ps(sum);
}

// Dims of a 32-dim chunk after interleaving two value rows with unpacklo/hi_epi16 (which work
// within 128-bit lanes): the low half's 16 pairs hold dims 8l + 0..3 of each lane l, the high
// half's dims 8l + 4..7. This index puts a result's 32 bf16 back in dim order.
static inline __m512i natural_dim_order(void) {
    int16_t index[32];
    for (int d = 0; d < 32; ++d) index[d] = (int16_t)((d % 8 < 4 ? 0 : 16) + (d / 8) * 4 + d % 4);
    return _mm512_loadu_si512(index);
}

// Adds probs_r[key] * values[key][d0 .. d0 + 32) to acc_lo/hi[r] for the keys of pairs
// [begin, end): two value rows at a time, read in place and interleaved into the pairs
// VDPBF16PS multiplies. Always inlined, so that callers can split the loop into runs with
// prefetches between them without a test in the loop (a branch in this loop slowed prefill
// attention 1.5x).
static inline __attribute__((always_inline)) void accumulate_values(
    const bf16* probs, int64_t probs_stride, const Bf16Rows* values, int64_t n_seen, int64_t d0,
    int64_t begin, int64_t end, __m512 acc_lo[ROW_BLOCK], __m512 acc_hi[ROW_BLOCK]) {
    for (int64_t pair = begin; pair < end; ++pair) {
        const __m512i first = _mm512_loadu_si512(bf16_row(values, 2 * pair) + d0);
        // An odd last key pairs with zeros (its probability is zero anyway).
        const __m512i second = 2 * pair + 1 < n_seen
                                   ? _mm512_loadu_si512(bf16_row(values, 2 * pair + 1) + d0)
                                   : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(first, second);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(first, second);
#pragma GCC unroll 8
        for (int r = 0; r < ROW_BLOCK; ++r) {
            const __m512bh p = broadcast_pair(probs + r * probs_stride + 2 * pair);
            acc_lo[r] = _mm512_dpbf16_ps(acc_lo[r], p, lo);
            acc_hi[r] = _mm512_dpbf16_ps(acc_hi[r], p, hi);
        }
    }
}

// out_r = (probs_r . values) / sums_r for ROW_BLOCK rows, num_rows of them written. The first
// pass over the keys requests `ahead` (the next task's values) in shares between runs of
// VALUE_RUN pairs; when a call finds it all requested, the passes run without a break.
static void block_values(const bf16* probs, int64_t probs_stride, const float* sums,
                         const Bf16Rows* values, int64_t n_seen, int64_t head_dim,
                         bf16* const out_rows[ROW_BLOCK], int num_rows, Prefetch* ahead) {
    const __m512i order = natural_dim_order();
    const int64_t num_key_pairs = (n_seen + 1) / 2;  // past that the probabilities are zero
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
        __m512 acc_lo[ROW_BLOCK], acc_hi[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
        if (d0 == 0 && ahead->done < ahead->n) {
            for (int64_t pair = 0; pair < num_key_pairs; pair += VALUE_RUN) {
                const int64_t end =
                    pair + VALUE_RUN < num_key_pairs ? pair + VALUE_RUN : num_key_pairs;
                prefetch_to(ahead, end * ahead->n / num_key_pairs);
                accumulate_values(probs, probs_stride, values, n_seen, d0, pair, end, acc_lo,
                                  acc_hi);
            }
        } else {
            accumulate_values(probs, probs_stride, values, n_seen, d0, 0, num_key_pairs, acc_lo,
                              acc_hi);
        }
        for (int r = 0; r < num_rows; ++r) {
            const __m512 inverse = _mm512_set1_ps(1.0f / sums[r]);
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(acc_hi[r], inverse),
                                                              _mm512_mul_ps(acc_lo[r], inverse));
            _mm512_storeu_si512(out_rows[r] + d0, _mm512_permutexvar_epi16(order, both));
        }
    }
}

// Where the values (or keys in slots: `kv` and its row stride) of a task's KV head lie.
static inline Bf16Rows kv_rows(const TaskKeys* seen, int64_t kv_head, const bf16* kv,
                               int64_t stride, int64_t head_dim, int64_t page_size) {
    return slot_rows(kv, seen->first_row, stride, kv_head, head_dim, seen->pages, page_size);
}

// The layout of the call's keys: rows of the stream or slots (`stride` apart), or a cache that
// keeps them packed.
typedef struct {
    const bf16* k;
    int64_t stride, num_kv_heads, head_dim, page_size;
    int packed;
} KeySource;

// A task's keys to request ahead: its slot rows, or its packed blocks.
static inline Prefetch keys_prefetch(const KeySource* keys, const TaskKeys* seen,
                                     int64_t kv_head) {
    if (keys->packed) {
        const Prefetch run = {packed_key_blocks(keys->k, kv_head, keys->num_kv_heads,
                                                keys->head_dim, seen->pages, keys->page_size),
                              (seen->n_seen + KEY_BLOCK - 1) / KEY_BLOCK,
                              KEYS_PER_PACKED_BLOCK * keys->head_dim * 2, 0};
        return run;
    }
    const Prefetch run = {
        kv_rows(seen, kv_head, keys->k, keys->stride, keys->head_dim, keys->page_size),
        seen->n_seen, keys->head_dim * 2, 0};
    return run;
}

// A task's `n` rows of values as a prefetch not yet requested.
static inline Prefetch prefetch_of(Bf16Rows rows, int64_t n, int64_t head_dim) {
    const Prefetch run = {rows, n, head_dim * 2, 0};
    return run;
}

static inline __m512 load16_bf16(const bf16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// The output (and log-sum-exp, where lse is given) of a decode's query heads on one KV head
// from its `count` splits (tasks[0..count), in order): each split's output weighted by its
// share of the sum of all the splits' exponentials, exp(lse_i - log-sum-exp).
static void merge_splits(const Task* tasks, int64_t count, const bf16* parts,
                         const float* part_lse, int64_t group, int64_t head_dim, bf16* out,
                         int64_t out_stride, float* lse, int64_t num_heads, int64_t token) {
    const int64_t first_head = tasks[0].kv_head * group;
    for (int64_t r = 0; r < group; ++r) {
        float largest = -INFINITY, total = 0.0f, weights[MAX_SPLITS];
        for (int64_t i = 0; i < count; ++i)
            largest = fmaxf(largest, part_lse[tasks[i].partial * group + r]);
        for (int64_t i = 0; i < count; ++i) {
            weights[i] = expf(part_lse[tasks[i].partial * group + r] - largest);
            total += weights[i];
        }
        bf16* dst = out + token * out_stride + (first_head + r) * head_dim;
        for (int64_t d = 0; d < head_dim; d += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < count; ++i) {
                const bf16* part = parts + (tasks[i].partial * group + r) * head_dim + d;
                acc = _mm512_fmadd_ps(_mm512_set1_ps(weights[i] / total), load16_bf16(part), acc);
            }
            _mm256_storeu_si256((__m256i*)(dst + d), (__m256i)_mm512_cvtneps_pbh(acc));
        }
        if (lse) lse[token * num_heads + first_head + r] = largest + logf(total);
    }
}

// Returns 0, -1 when a buffer could not be allocated, or -2 when a new key's slot lies outside
// the cache. With page_tables NULL, keys and values of sequence b are rows cu_k[b].. of k and v;
// else k and v are the cache's slots and page_tables[b * pages_stride ..] is b's page table
// (cu_k still gives the key counts), with keys_packed k holds the keys packed (varlen_tasks.h;
// page_size a multiple of 16), and the call first stores num_new new keys and values (bf16
// rows new_k_stride and new_v_stride elements apart) to slots new_slots (kv_store.h). With lse
// not NULL, each row's log-sum-exp of its scaled scores goes to lse[token * num_heads + head],
// for merging with attention over other keys.
int varlen_attention_bf16(VARLEN_ATTENTION_PARAMS(bf16, bf16)) {
    if (!kv_bf16) return -1;  // the float32 kernel's argument: here k and v are bf16 like q
    if (keys_packed && (!page_tables || page_size % KEYS_PER_PACKED_BLOCK)) return -1;
    const NewKV new_kv = {new_k, new_v, new_slots, num_new, new_k_stride, new_v_stride, num_slots};
    if (!new_kv_fits(&new_kv)) return -2;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_pairs = head_dim / 2;
    int64_t num_tasks, max_keys;
    Task* tasks =
        build_tasks(cu_q, cu_k, num_seqs, num_kv_heads, QUERY_CHUNK, &num_tasks, &max_keys);
    if (!tasks) return -1;
    order_by_work(tasks, num_tasks, cu_q, cu_k, causal);
    // A lone long decode would leave threads idle: its keys are split over several tasks
    // (split-K) whose partial results (outputs in bf16, log-sum-exps) merge at the end.
    int64_t num_partials = 0;
    if (page_tables)
        tasks = split_decodes(tasks, &num_tasks, cu_q, cu_k, page_size, num_threads,
                              &num_partials);
    bf16* parts = malloc(num_partials * group * head_dim * sizeof(bf16) + 64);
    float* part_lse = malloc(num_partials * group * sizeof(float) + 64);
    // The first task of each decode's splits, in order.
    int64_t* merges = malloc((num_partials + 1) * sizeof(int64_t));  // + 1: never malloc(0)
    if (!parts || !part_lse || !merges) {
        free(parts);
        free(part_lse);
        free(merges);
        free(tasks);
        return -1;
    }
    int64_t num_merges = 0;
    for (int64_t i = 0; i < num_tasks; ++i)
        if (tasks[i].partial >= 0 && (i == 0 || tasks[i - 1].partial < 0 ||
                                      tasks[i - 1].seq != tasks[i].seq ||
                                      tasks[i - 1].kv_head != tasks[i].kv_head))
            merges[num_merges++] = i;
    const int64_t max_padded = round_up(max_keys, 2 * KEY_BLOCK);
    const float log2_scale = scale * LOG2E;
    int failed = 0;
    int64_t next_task = 0;  // the next task no thread has claimed
    const KeySource key_source = {k, k_stride, num_kv_heads, head_dim, page_size, keys_packed};

#pragma omp parallel num_threads(num_threads)
    {
        store_new_kv(&new_kv, k, v, k_stride, v_stride, num_kv_heads, head_dim, page_size,
                     keys_packed, sizeof(bf16));
        // The thread's packed keys; a cache that keeps them packed needs no copy.
        bf16* keys =
            keys_packed ? NULL : aligned_alloc(64, round_up(max_padded * head_dim * 2, 64));
        float* scores = aligned_alloc(64, round_up(ROW_BLOCK * max_padded * 4, 64));
        bf16* probs = aligned_alloc(64, round_up(ROW_BLOCK * max_padded * 2, 64));
        const int allocated = (keys || keys_packed) && scores && probs;
        if (!allocated) {
#pragma omp atomic write
            failed = 1;
        }
        // Each thread claims its next task before it starts the current one, so that it knows
        // whose keys and values to request while it computes: a decode's lie in pages scattered
        // over the cache, where the hardware prefetchers stop at each page's end and its own
        // reads keep too few misses in flight. The requests go out in shares spread over the
        // current task's packing (the next keys) and value product (the next values): issued
        // all at once they stalled the core on its full miss queue. G1's decode batch (64
        // sequences, 24 layers, 2-core Zen 4, interleaved builds): 34-41 -> 29-33 ms per step
        // with two threads, 59-67 -> 47-54 ms with one, against requesting the task's own rows
        // up front and guessing the next task as i + threads; prefill attention unchanged.
        int64_t next = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
        if (allocated && next < num_tasks) {  // the thread's first task: nothing to overlap
            const Task first = tasks[next];
            const TaskKeys seen = task_keys(first, cu_q, cu_k, page_tables, pages_stride, causal);
            Prefetch first_keys = keys_prefetch(&key_source, &seen, first.kv_head);
            Prefetch first_values = prefetch_of(
                kv_rows(&seen, first.kv_head, v, v_stride, head_dim, page_size), seen.n_seen,
                head_dim);
            prefetch_to(&first_keys, first_keys.n);
            prefetch_to(&first_values, first_values.n);
        }
        while (allocated && next < num_tasks) {
            const int64_t i = next;
            next = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
            const Task task = tasks[i];
            const TaskKeys seen = task_keys(task, cu_q, cu_k, page_tables, pages_stride, causal);
            const int64_t n_k = seen.n_k, n_seen = seen.n_seen;
            const int64_t first_position = seen.first_position;  // of query 0, when causal
            const Bf16Rows value_rows =
                kv_rows(&seen, task.kv_head, v, v_stride, head_dim, page_size);
            Prefetch next_keys = NO_PREFETCH, next_values = NO_PREFETCH;
            if (next < num_tasks) {
                const Task later = tasks[next];
                const TaskKeys later_seen =
                    task_keys(later, cu_q, cu_k, page_tables, pages_stride, causal);
                next_keys = keys_prefetch(&key_source, &later_seen, later.kv_head);
                next_values = prefetch_of(
                    kv_rows(&later_seen, later.kv_head, v, v_stride, head_dim, page_size),
                    later_seen.n_seen, head_dim);
            }
            // The task's keys in packed blocks: in place in a cache that keeps them so, else
            // packed into the thread's buffer.
            Bf16Rows key_blocks = {keys, num_pairs * 2 * KEY_BLOCK, NULL, 1, 0};
            if (keys_packed) {
                key_blocks = packed_key_blocks(k, task.kv_head, num_kv_heads, head_dim,
                                               seen.pages, page_size);
            } else {
                const Bf16Rows key_rows =
                    kv_rows(&seen, task.kv_head, k, k_stride, head_dim, page_size);
                pack_keys(&key_rows, n_seen, num_pairs, round_up(n_seen, 2 * KEY_BLOCK), keys,
                          &next_keys);
            }
            // Rows: (query, head of the group), query-major.
            const int64_t num_task_rows = (task.query_end - task.query_start) * group;
            for (int64_t r0 = 0; r0 < num_task_rows; r0 += ROW_BLOCK) {
                const int num_rows =
                    (int)(num_task_rows - r0 < ROW_BLOCK ? num_task_rows - r0 : ROW_BLOCK);
                const bf16* rows[ROW_BLOCK];
                bf16* out_rows[ROW_BLOCK];
                int64_t visible[ROW_BLOCK];
                float sums[ROW_BLOCK], maxima[ROW_BLOCK];
                float* lse_rows[ROW_BLOCK];
                for (int r = 0; r < ROW_BLOCK; ++r) {
                    // Rows past the block's end repeat its first row and are never written.
                    const int64_t row = r0 + (r < num_rows ? r : 0);
                    const int64_t query = task.query_start + row / group;
                    const int64_t head = task.kv_head * group + row % group;
                    const int64_t token = cu_q[task.seq] + query;
                    rows[r] = q + token * q_stride + head * head_dim;
                    if (task.partial >= 0) {  // a split: its partial result, to merge
                        out_rows[r] = parts + (task.partial * group + row) * head_dim;
                        lse_rows[r] = part_lse + task.partial * group + row;
                    } else {
                        out_rows[r] = out + token * out_stride + head * head_dim;
                        lse_rows[r] = lse ? lse + token * num_heads + head : NULL;
                    }
                    visible[r] = causal ? first_position + query + 1 : n_k;
                }
                // Query-major rows: the block's last row sees the most keys.
                const int64_t block_seen = visible[num_rows - 1];
                const int64_t block_padded = round_up(block_seen, 2 * KEY_BLOCK);
                block_scores(rows, &key_blocks, num_pairs,
                             (block_seen + KEY_BLOCK - 1) / KEY_BLOCK, scores, max_padded,
                             &next_keys);
                for (int r = 0; r < ROW_BLOCK; ++r)
                    sums[r] = row_softmax(scores + r * max_padded, visible[r], block_padded,
                                          log2_scale, probs + r * max_padded, &maxima[r]);
                for (int r = 0; r < num_rows; ++r)
                    if (lse_rows[r]) *lse_rows[r] = (maxima[r] + log2f(sums[r])) * LN2;
                block_values(probs, max_padded, sums, &value_rows, block_seen, head_dim,
                             out_rows, num_rows, &next_values);
            }
        }
        free(keys);
        free(scores);
        free(probs);
        // Every split written (the barrier), each decode's splits merge into its output.
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t m = 0; m < num_merges; ++m) {
            const Task* first = tasks + merges[m];
            int64_t count = 1;
            while (merges[m] + count < num_tasks && first[count].partial >= 0 &&
                   first[count].seq == first->seq && first[count].kv_head == first->kv_head)
                ++count;
            merge_splits(first, count, parts, part_lse, group, head_dim, out, out_stride, lse,
                         num_heads, cu_q[first->seq]);
        }
    }
    free(tasks);
    free(parts);
    free(part_lse);
    free(merges);
    return failed ? -1 : 0;
}
