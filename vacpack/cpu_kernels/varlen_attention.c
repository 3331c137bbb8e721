// Packed (variable-length) attention on bf16 for x86 CPUs with AVX512-BF16.
//
// q, k and v are 1-D token streams: [tokens, heads, head_dim] with any token stride; sequence b
// owns query rows cu_q[b]..cu_q[b+1] and key rows cu_k[b]..cu_k[b+1]. No padding exists anywhere:
// each sequence attends only to its own keys. Causal attention is aligned bottom-right: query i
// of a sequence with n_q queries and n_k keys sees keys 0..n_k-n_q+i, so the same call serves a
// fresh prefill (n_k == n_q) and a prefill chunk over cached keys (n_k > n_q).
//
// One task is (sequence, KV head, chunk of queries). It packs the keys it can see into the
// layout VDPBF16PS wants (pairs of dims of 16 keys side by side), then for each block of
// ROW_BLOCK query rows of every query head in the group: scores in float32 registers, a float32
// softmax with a polynomial exp2, probabilities rounded to bf16 as in flash-attention kernels,
// and the value product with the same instruction. A block's scores live in a per-thread
// buffer, so no [queries, keys] matrix is ever written to memory.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEY_BLOCK 16
#define ROW_BLOCK 8
#define QUERY_CHUNK 64
#define LOG2E 1.4426950408889634f

typedef uint16_t bf16;

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 2^x for x <= 0, float32 accuracy (relative error below 2e-7); 0 from x = -126 down is not
// reached because callers only pass scores of visible keys, which are >= -126 after clamping.
static inline __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);  // in [-0.5, 0.5]
    // 2^f = e^(f ln 2): Taylor terms (ln 2)^k / k! to degree 6.
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512bh broadcast_pair(const bf16* pair) {
    int32_t bits;
    memcpy(&bits, pair, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
}

static inline __m512bh load_bh(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// keys[0..n) of one KV head -> packed[key_block][dim_pair][16 keys][2 dims], zero past n.
static void pack_keys(const bf16* k, int64_t k_stride, int64_t n, int64_t num_pairs,
                      int64_t n_padded, bf16* packed) {
    for (int64_t block = 0; block < n_padded / KEY_BLOCK; ++block) {
        bf16* dst = packed + block * num_pairs * 2 * KEY_BLOCK;
        for (int64_t lane = 0; lane < KEY_BLOCK; ++lane) {
            const int64_t key = block * KEY_BLOCK + lane;
            const bf16* src = k + key * k_stride;
            for (int64_t pair = 0; pair < num_pairs; ++pair) {
                bf16* slot = dst + pair * 2 * KEY_BLOCK + lane * 2;
                if (key < n) {
                    slot[0] = src[2 * pair];
                    slot[1] = src[2 * pair + 1];
                } else {
                    slot[0] = slot[1] = 0;
                }
            }
        }
    }
}

// values[0..n) of one KV head -> packed[key_pair][dim][2 keys], zero past n.
static void pack_values(const bf16* v, int64_t v_stride, int64_t n, int64_t head_dim,
                        int64_t n_padded, bf16* packed) {
    for (int64_t pair = 0; pair < n_padded / 2; ++pair) {
        bf16* dst = packed + pair * 2 * head_dim;
        for (int64_t half = 0; half < 2; ++half) {
            const int64_t key = 2 * pair + half;
            if (key < n) {
                const bf16* src = v + key * v_stride;
                for (int64_t d = 0; d < head_dim; ++d) dst[2 * d + half] = src[d];
            } else {
                for (int64_t d = 0; d < head_dim; ++d) dst[2 * d + half] = 0;
            }
        }
    }
}

// scores[r][0..n_padded) = q_r . key for ROW_BLOCK rows (rows past the block repeat a real row
// and are never read back).
static void block_scores(const bf16* const rows[ROW_BLOCK], const bf16* packed_keys,
                         int64_t num_pairs, int64_t n_padded, float* scores, int64_t stride) {
    const int64_t num_blocks = n_padded / KEY_BLOCK;
    int64_t block = 0;
    for (; block + 1 < num_blocks; block += 2) {
        __m512 acc0[ROW_BLOCK], acc1[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
        const bf16* k0 = packed_keys + block * num_pairs * 2 * KEY_BLOCK;
        const bf16* k1 = k0 + num_pairs * 2 * KEY_BLOCK;
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
        __m512 acc[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; ++r) acc[r] = _mm512_setzero_ps();
        const bf16* k0 = packed_keys + block * num_pairs * 2 * KEY_BLOCK;
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
// n_padded (zeros past `visible`); returns the float32 sum of the probabilities.
static float row_softmax(const float* scores, int64_t visible, int64_t n_padded, float log2_scale,
                         bf16* probs) {
    __m512 max_vec = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n_padded; j += KEY_BLOCK) {
        const int64_t left = visible - j;
        if (left <= 0) break;
        const __mmask16 mask = left >= KEY_BLOCK ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        max_vec = _mm512_mask_max_ps(max_vec, mask, max_vec, _mm512_loadu_ps(scores + j));
    }
    const __m512 offset = _mm512_set1_ps(_mm512_reduce_max_ps(max_vec) * log2_scale);
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

// out_r = (probs_r . values) / sums_r for ROW_BLOCK rows, num_rows of them written.
static void block_values(const bf16* probs, int64_t probs_stride, const float* sums,
                         const bf16* packed_values, int64_t head_dim, int64_t n_padded,
                         bf16* const out_rows[ROW_BLOCK], int num_rows) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
        __m512 acc0[ROW_BLOCK], acc1[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
        for (int64_t pair = 0; pair < n_padded / 2; ++pair) {
            const bf16* v = packed_values + pair * 2 * head_dim + 2 * d0;
            const __m512bh values0 = load_bh(v);
            const __m512bh values1 = load_bh(v + 32);
#pragma GCC unroll 8
            for (int r = 0; r < ROW_BLOCK; ++r) {
                const __m512bh p = broadcast_pair(probs + r * probs_stride + 2 * pair);
                acc0[r] = _mm512_dpbf16_ps(acc0[r], p, values0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], p, values1);
            }
        }
        for (int r = 0; r < num_rows; ++r) {
            const __m512 inverse = _mm512_set1_ps(1.0f / sums[r]);
            _mm256_storeu_si256((__m256i*)(out_rows[r] + d0),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc0[r], inverse)));
            _mm256_storeu_si256((__m256i*)(out_rows[r] + d0 + 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc1[r], inverse)));
        }
    }
}

typedef struct {
    int64_t seq, kv_head, query_start, query_end;
} Task;

// Returns 0, or -1 when a buffer could not be allocated.
int varlen_attention_bf16(const bf16* q, const bf16* k, const bf16* v, bf16* out,
                          const int64_t* cu_q, const int64_t* cu_k, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t q_stride, int64_t k_stride, int64_t v_stride,
                          int64_t out_stride, float scale, int causal, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_pairs = head_dim / 2;
    int64_t num_tasks = 0, max_keys = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n_q = cu_q[s + 1] - cu_q[s], n_k = cu_k[s + 1] - cu_k[s];
        num_tasks += num_kv_heads * ((n_q + QUERY_CHUNK - 1) / QUERY_CHUNK);
        if (n_k > max_keys) max_keys = n_k;
    }
    Task* tasks = malloc(sizeof(Task) * (num_tasks > 0 ? num_tasks : 1));
    if (!tasks) return -1;
    int64_t t = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n_q = cu_q[s + 1] - cu_q[s];
        for (int64_t start = 0; start < n_q; start += QUERY_CHUNK)
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                tasks[t].seq = s;
                tasks[t].kv_head = h;
                tasks[t].query_start = start;
                tasks[t].query_end = start + QUERY_CHUNK < n_q ? start + QUERY_CHUNK : n_q;
                ++t;
            }
    }
    const int64_t max_padded = round_up(max_keys, 2 * KEY_BLOCK);
    const float log2_scale = scale * LOG2E;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        bf16* keys = aligned_alloc(64, round_up(max_padded * head_dim * 2, 64));
        bf16* values = aligned_alloc(64, round_up(max_padded * head_dim * 2, 64));
        float* scores = aligned_alloc(64, round_up(ROW_BLOCK * max_padded * 4, 64));
        bf16* probs = aligned_alloc(64, round_up(ROW_BLOCK * max_padded * 2, 64));
        const int allocated = keys && values && scores && probs;
        if (!allocated) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; ++i) {
            if (!allocated) continue;  // reported through `failed`
            const Task task = tasks[i];
            const int64_t n_q = cu_q[task.seq + 1] - cu_q[task.seq];
            const int64_t n_k = cu_k[task.seq + 1] - cu_k[task.seq];
            const int64_t first_position = n_k - n_q;  // of query 0, when causal
            const int64_t n_seen = causal ? first_position + task.query_end : n_k;
            const int64_t n_padded = round_up(n_seen, 2 * KEY_BLOCK);
            pack_keys(k + cu_k[task.seq] * k_stride + task.kv_head * head_dim, k_stride, n_seen,
                      num_pairs, n_padded, keys);
            pack_values(v + cu_k[task.seq] * v_stride + task.kv_head * head_dim, v_stride, n_seen,
                        head_dim, n_padded, values);
            for (int64_t head = task.kv_head * group; head < (task.kv_head + 1) * group; ++head) {
                for (int64_t r0 = task.query_start; r0 < task.query_end; r0 += ROW_BLOCK) {
                    const int num_rows =
                        (int)(task.query_end - r0 < ROW_BLOCK ? task.query_end - r0 : ROW_BLOCK);
                    const bf16* rows[ROW_BLOCK];
                    bf16* out_rows[ROW_BLOCK];
                    float sums[ROW_BLOCK];
                    for (int r = 0; r < ROW_BLOCK; ++r) {
                        const int64_t row = cu_q[task.seq] + r0 + (r < num_rows ? r : 0);
                        rows[r] = q + row * q_stride + head * head_dim;
                        out_rows[r] = out + row * out_stride + head * head_dim;
                    }
                    // Keys this block needs: up to its last row's, when causal.
                    const int64_t block_seen =
                        causal ? first_position + r0 + num_rows : n_seen;
                    const int64_t block_padded = round_up(block_seen, 2 * KEY_BLOCK);
                    block_scores(rows, keys, num_pairs, block_padded, scores, max_padded);
                    for (int r = 0; r < ROW_BLOCK; ++r) {
                        const int64_t visible =
                            r >= num_rows ? 1 : causal ? first_position + r0 + r + 1 : n_k;
                        sums[r] = row_softmax(scores + r * max_padded, visible, block_padded,
                                              log2_scale, probs + r * max_padded);
                    }
                    block_values(probs, max_padded, sums, values, head_dim, block_padded,
                                 out_rows, num_rows);
                }
            }
        }
        free(keys);
        free(values);
        free(scores);
        free(probs);
    }
    free(tasks);
    return failed ? -1 : 0;
}
