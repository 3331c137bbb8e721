// Decode attention over a paged bf16 KV cache with the bf16 dot-product instruction
// (VDPBF16PS: x86 with AVX512-BF16, Zen 4 and Cooper Lake on), keys read in the layout the
// instruction takes. The same call, tasks and results as paged_decode.c (decode_tasks.h: a
// task per sequence and range of its keys, split-K, merged by log-sum-exp) and its
// heads-in-lanes form: a KV head's grouped query heads in the lanes of a vector (eight per
// vector), so that one vector holds one key's scores for all of them and the online softmax
// runs without horizontal sums.
//
// The instruction adds to each float32 lane the products of one pair of bf16 values of each
// operand. With the heads in lanes, a lane's pair is its head's query dims (2p, 2p + 1) and the
// other operand is the key's dims (2p, 2p + 1) broadcast: one 4-byte word of the key's row,
// which the cache keeps contiguous. So a key is read where it lies, a pair of dims per
// instruction (half the float32 kernel's multiply-adds and no widening of the bf16 cache),
// with no transposes. The value product takes pairs of keys: a lane's pair is its head's
// weights of keys j and j + 1 (rounded to bf16, as flash-attention kernels round them), the
// other operand the two keys' value at one dim, from the block's value rows interleaved in key
// pairs (two permutes per 16 dims of a pair of rows).
//
// Built with -DVACPACK_EMULATE_DPBF16 (build.py's "emulated_dpbf16" variant) the instruction
// is plain C following its definition, on any CPU: tests of this kernel where the CPU lacks
// AVX512-BF16. The engine runs it only where the sdpa_decode phase measures it fastest.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_tasks.h"
#include "vec16.h"
#include "vec8.h"

#define KEY_BLOCK 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256  // a multiple of 16 (the value rows are interleaved 16 dims at a time)

#ifdef VACPACK_EMULATE_DPBF16
// VDPBF16PS as Intel's manual defines it: per lane, the odd pair's product added, then the
// even pair's (each product of two bf16 values is exact in float32, so only the adds round).
// The instruction also flushes denormals, which this keeps: a difference at float32 rounding.
static inline v8f dpbf16(v8f acc, v8u a, v8u b) {
    v8f a_even, a_odd, b_even, b_odd;
    const v8u a_even_bits = a << 16, a_odd_bits = a & 0xFFFF0000u;
    const v8u b_even_bits = b << 16, b_odd_bits = b & 0xFFFF0000u;
    memcpy(&a_even, &a_even_bits, sizeof(a_even));
    memcpy(&a_odd, &a_odd_bits, sizeof(a_odd));
    memcpy(&b_even, &b_even_bits, sizeof(b_even));
    memcpy(&b_odd, &b_odd_bits, sizeof(b_odd));
    acc += a_odd * b_odd;
    return acc + a_even * b_even;
}
#else
#include <immintrin.h>
static inline v8f dpbf16(v8f acc, v8u a, v8u b) {
    return (v8f)_mm256_dpbf16_ps((__m256)acc, (__m256bh)a, (__m256bh)b);
}
#endif

// A 4-byte word of a bf16 row (a pair of its elements) in every lane.
static inline v8u splat_pair(const bf16* p) {
    uint32_t word;
    memcpy(&word, p, sizeof(word));
    return (v8u){word, word, word, word, word, word, word, word};
}

// float32 lanes rounded to bf16 (nearest even), kept in the low half of each 32-bit lane.
static inline v8u bf16_bits(v8f x) {
    v8u bits;
    memcpy(&bits, &x, sizeof(bits));
    return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// One lane group's block: up to eight query heads (lanes) of one KV head against `count` keys.
// queries: the group's [dim / 2] pairs, lane h holding head h's dims (2p, 2p + 1), idle lanes
// zero. value_pairs: the block's value rows interleaved in key pairs, [(count + 1) / 2][dim]
// words. Updates the heads' running max, sum and outputs ([dim][8]: lane h of each dim, head
// h).
static inline __attribute__((always_inline)) void block_pairs(
    const v8u* queries, const bf16* const* key_rows, const bf16* value_pairs, int64_t count,
    int64_t lanes, int64_t dim, float log2_scale, float* running_max, float* running_sum,
    float* outputs) {
    v8f scores[KEY_BLOCK];
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
        // A block's last keys past `count` repeat its last key; their scores go unread.
        const bf16* rows8[8];
        for (int64_t j = 0; j < 8; ++j) rows8[j] = key_rows[j0 + j < count ? j0 + j : count - 1];
        v8f dots[8] = {{0}};
        for (int64_t p = 0; p < dim / 2; ++p) {
            const v8u pair = queries[p];
            for (int64_t j = 0; j < 8; ++j)
                dots[j] = dpbf16(dots[j], pair, splat_pair(rows8[j] + 2 * p));
        }
        for (int64_t j = 0; j < 8; ++j) scores[j0 + j] = dots[j] * log2_scale;
    }
    v8f top, total;
    const v8f rescale =
        lanes_rescale(scores, count, lanes, running_max, running_sum, &top, &total);
    v8u weight_pairs[KEY_BLOCK / 2];
    for (int64_t j = 0; j < count; j += 2) {
        const v8f even = exp2_nonpositive8(scores[j] - top);
        const v8f odd = j + 1 < count ? exp2_nonpositive8(scores[j + 1] - top) : (v8f){0};
        total += even + odd;
        weight_pairs[j / 2] = bf16_bits(even) | (bf16_bits(odd) << 16);
    }
    lanes_store(top, total, lanes, running_max, running_sum);
    const int64_t num_pairs = (count + 1) / 2;
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
        v8f acc[8];
        for (int64_t i = 0; i < 8; ++i) acc[i] = load8(outputs + 8 * (d0 + i)) * rescale;
        for (int64_t p = 0; p < num_pairs; ++p) {
            const v8u weights = weight_pairs[p];
            const bf16* pair_row = value_pairs + p * dim * 2 + 2 * d0;
            for (int64_t i = 0; i < 8; ++i)
                acc[i] = dpbf16(acc[i], weights, splat_pair(pair_row + 2 * i));
        }
        for (int64_t i = 0; i < 8; ++i) store8(outputs + 8 * (d0 + i), acc[i]);
    }
}

// One task (decode_tasks.h's AttendFunction; no transposed queries from the caller): keys
// key_start..key_end of sequence `seq`, every KV head, into `part` (heads-in-lanes layout).
// Inlined into copies with head_dim constant, so that the products' loops have fixed counts.
static inline __attribute__((always_inline)) void attend_task(const Problem* pr, int64_t seq,
                                                              int64_t key_start,
                                                              int64_t key_end, float* part,
                                                              int64_t dim) {
    const int64_t group = pr->num_heads / pr->num_kv_heads, groups = lane_groups(pr);
    const int64_t slot_stride = pr->num_kv_heads * dim;
    const int64_t* pages = pr->pages + seq * pr->pages_per_seq;
    const bf16 *keys = pr->keys, *values = pr->values;
    float* running_max = part;
    float* running_sum = part + pr->num_heads;
    float* outputs = part + 2 * pr->num_heads;  // [kv_heads][groups][dim][8 lanes]
    for (int64_t h = 0; h < pr->num_heads; ++h) {
        running_max[h] = -INFINITY;
        running_sum[h] = 0.0f;
    }
    memset(outputs, 0, pr->num_kv_heads * groups * dim * 8 * sizeof(float));
    const float log2_scale = pr->scale * LOG2E;
    // The KV head's queries as pairs, per lane group g: [dim / 2] words, lane h head 8g + h's.
    v8u queries[MAX_GROUP / 8 * MAX_HEAD_DIM / 2];
    bf16 value_pairs[KEY_BLOCK * MAX_HEAD_DIM] __attribute__((aligned(32)));
    const bf16* key_rows[KEY_BLOCK];
    int64_t slots[KEY_BLOCK];
    for (int64_t kv_head = 0; kv_head < pr->num_kv_heads; ++kv_head) {
        const bf16* q = (const bf16*)pr->q + (seq * pr->num_heads + kv_head * group) * dim;
        memset(queries, 0, groups * dim / 2 * sizeof(v8u));
        for (int64_t h = 0; h < group; ++h)
            for (int64_t p = 0; p < dim / 2; ++p) {
                uint32_t word;
                memcpy(&word, q + h * dim + 2 * p, sizeof(word));
                queries[(h / 8) * dim / 2 + p][h % 8] = word;
            }
        for (int64_t start = key_start; start < key_end; start += KEY_BLOCK) {
            const int64_t count = key_end - start < KEY_BLOCK ? key_end - start : KEY_BLOCK;
            for (int64_t j = 0; j < count; ++j) {
                const int64_t key = start + j;
                slots[j] = pages[key / pr->page_size] * pr->page_size + key % pr->page_size;
                key_rows[j] = keys + slots[j] * slot_stride + kv_head * dim;
            }
            for (int64_t j = 0; j < count; j += 2) {
                const bf16* even = values + slots[j] * slot_stride + kv_head * dim;
                const bf16* odd =
                    j + 1 < count ? values + slots[j + 1] * slot_stride + kv_head * dim : NULL;
                interleave_rows(even, odd, dim, value_pairs + j * dim);
                // The next block's rows of this KV head, on their way during this block.
                for (int i = 0; i < 2; ++i) {
                    const int64_t ahead = start + KEY_BLOCK + j + i;
                    if (ahead >= key_end) break;
                    const int64_t slot =
                        pages[ahead / pr->page_size] * pr->page_size + ahead % pr->page_size;
                    const int64_t at = slot * slot_stride + kv_head * dim;
                    for (int64_t byte = 0; byte < dim * (int64_t)sizeof(bf16); byte += 64) {
                        __builtin_prefetch((const char*)(keys + at) + byte);
                        __builtin_prefetch((const char*)(values + at) + byte);
                    }
                }
            }
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t first = kv_head * group + 8 * g;
                const int64_t lanes = group - 8 * g < 8 ? group - 8 * g : 8;
                block_pairs(queries + g * dim / 2, key_rows, value_pairs, count, lanes, dim,
                            log2_scale, running_max + first, running_sum + first,
                            outputs + (kv_head * groups + g) * dim * 8);
            }
        }
    }
}

#define DEFINE_ATTEND(NAME, DIM)                                                             \
    static void NAME(const Problem* pr, const v8f* unused, int64_t seq, int64_t key_start,  \
                     int64_t key_end, float* part) {                                         \
        (void)unused;                                                                        \
        attend_task(pr, seq, key_start, key_end, part, DIM);                                 \
    }

DEFINE_ATTEND(attend_any, pr->head_dim)
DEFINE_ATTEND(attend_d64, 64)
DEFINE_ATTEND(attend_d128, 128)

// paged_decode_attention's call (paged_decode.c) for bf16 queries, cache and output: -1 where
// the shape is past the kernel (group over 16, head_dim not a multiple of 16 or over 256) or
// memory runs out.
int paged_decode_bf16(const bf16* q, const bf16* keys, const bf16* values, const int64_t* pages,
                      const int64_t* key_range, bf16* out, float* lse, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t page_size, int64_t pages_per_seq, float scale, int threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || head_dim % 16) return -1;
    const Problem problem = {q, keys, values, pages, key_range, num_heads, num_kv_heads,
                             head_dim, page_size, pages_per_seq, scale, 1, 1};
    const AttendFunction attend =
        head_dim == 64 ? attend_d64 : head_dim == 128 ? attend_d128 : attend_any;
    return run_decode_tasks(&problem, attend, NULL, 0, out, lse, num_seqs, threads);
}
