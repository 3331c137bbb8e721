// The tasks of a packed attention call, shared by varlen_attention.c (bf16),
// varlen_attention_amx.c (bf16 on AMX tiles) and varlen_attention_f32.c: one per (sequence, KV
// head, chunk of its queries), so that a task's rows (the chunk's queries times the query heads
// sharing the KV head) see almost the same keys and the threads share the work out
// dynamically; the bf16 kernel also runs them largest first (order_by_work) and splits a few
// long decodes' keys over several tasks (split_decodes). Also where a bf16 kernel's keys and
// values lie, keys packed or not.

#ifndef VACPACK_VARLEN_TASKS_H
#define VACPACK_VARLEN_TASKS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "split_policy.h"

// The parameters of every varlen attention kernel (varlen_attention_bf16, _amx, _f32; their
// ctypes twin is attention.py's _ARGTYPES): queries and outputs of type QT, keys and values of
// KVT (written to when the call stores a step's new ones, kv_store.h).
#define VARLEN_ATTENTION_PARAMS(QT, KVT)                                                     \
    const QT *q, KVT *k, KVT *v, QT *out, const int64_t *cu_q, const int64_t *cu_k,         \
        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,         \
        int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t out_stride,            \
        const int64_t *page_tables, int64_t pages_stride, int64_t page_size, int keys_packed, \
        float *lse, float scale, int causal, int kv_bf16, int num_threads,                   \
        const void *new_k, const void *new_v, const int64_t *new_slots, int64_t num_new,     \
        int64_t new_k_stride, int64_t new_v_stride, int64_t num_slots

typedef struct {
    int64_t seq, kv_head, query_start, query_end;
    // A split of a decode's keys (split_decodes): its first page, its number of keys (0: the
    // task is not split and sees all of them), and the row of partial results it writes.
    int64_t first_page, num_keys, partial;
} Task;

// The tasks of sequences 0..num_seqs (queries cu_q[b]..cu_q[b+1], key counts from cu_k), in
// chunks of at most query_chunk queries; NULL when out of memory. *num_tasks gets their number
// and *max_keys the most keys any sequence has. The caller frees the array.
static Task* build_tasks(const int64_t* cu_q, const int64_t* cu_k, int64_t num_seqs,
                         int64_t num_kv_heads, int64_t query_chunk, int64_t* num_tasks,
                         int64_t* max_keys) {
    int64_t count = 0, most_keys = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n_q = cu_q[s + 1] - cu_q[s], n_k = cu_k[s + 1] - cu_k[s];
        count += num_kv_heads * ((n_q + query_chunk - 1) / query_chunk);
        if (n_k > most_keys) most_keys = n_k;
    }
    Task* tasks = malloc(sizeof(Task) * (count > 0 ? count : 1));
    if (!tasks) return NULL;
    int64_t t = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n_q = cu_q[s + 1] - cu_q[s];
        for (int64_t start = 0; start < n_q; start += query_chunk)
            for (int64_t h = 0; h < num_kv_heads; ++h) {
                tasks[t].seq = s;
                tasks[t].kv_head = h;
                tasks[t].query_start = start;
                tasks[t].query_end = start + query_chunk < n_q ? start + query_chunk : n_q;
                tasks[t].first_page = tasks[t].num_keys = 0;
                tasks[t].partial = -1;
                ++t;
            }
    }
    *num_tasks = count;
    *max_keys = most_keys;
    return tasks;
}

// Orders the tasks by the size class of their work (the queries times the keys the last one
// sees, in powers of two), largest first, keeping their order within a class: a counting sort,
// linear in the tasks, so that it costs a call next to nothing. Threads claiming tasks in turn
// then end a call together, and each thread's consecutive tasks are alike in size. That matters
// to the bf16 kernel, which requests the next task's keys and values in shares along the
// current one: a long task after a short one found most of its bytes not yet requested, and
// along a long task before a short one the memory bus idled. G1's decode batch (64 contexts of
// 32..1,152 keys in sequence order, 24 layers, 2-core Zen 4, interleaved builds): 26.3-26.8 ->
// 25.0-25.4 ms a step with 2 threads, 37.1-37.2 -> 36.4-36.6 ms of CPU time with one; prefill
// chunks and batches of like contexts unchanged. Out of memory, the order stays.
static void order_by_work(Task* tasks, int64_t num_tasks, const int64_t* cu_q,
                          const int64_t* cu_k, int causal) {
    enum { NUM_CLASSES = 65 };  // 0 for no work, else 1 + floor(log2(work))
    int64_t first_of_class[NUM_CLASSES] = {0};
    unsigned char* classes = malloc(num_tasks > 0 ? num_tasks : 1);
    Task* sorted = malloc(sizeof(Task) * (num_tasks > 0 ? num_tasks : 1));
    if (classes && sorted) {
        for (int64_t i = 0; i < num_tasks; ++i) {
            const Task t = tasks[i];
            const int64_t n_q = cu_q[t.seq + 1] - cu_q[t.seq];
            const int64_t n_k = cu_k[t.seq + 1] - cu_k[t.seq];
            const int64_t seen = causal ? n_k - n_q + t.query_end : n_k;
            const int64_t work = (t.query_end - t.query_start) * seen;
            classes[i] = work > 0 ? (unsigned char)(64 - __builtin_clzll((uint64_t)work)) : 0;
            ++first_of_class[classes[i]];
        }
        int64_t next = 0;  // counts -> each class's first place, largest class first
        for (int c = NUM_CLASSES - 1; c >= 0; --c) {
            const int64_t count = first_of_class[c];
            first_of_class[c] = next;
            next += count;
        }
        for (int64_t i = 0; i < num_tasks; ++i) sorted[first_of_class[classes[i]]++] = tasks[i];
        memcpy(tasks, sorted, sizeof(Task) * num_tasks);
    }
    free(classes);
    free(sorted);
}

// Where row j of one KV head lies among bf16 keys or values (varlen_attention.c and
// varlen_attention_amx.c): a row of the token stream, or a slot of a paged cache. A cache that
// keeps its keys packed (below) is read through the same struct, a row being a block of 16 keys.
typedef struct {
    const uint16_t* base;  // the KV head's first element of row 0 (or of page 0's first row)
    int64_t stride;        // elements from one row (slot) of a page to the next
    const int64_t* pages;  // NULL for stream rows; else this sequence's page table
    int64_t page_size;     // rows per page
    int64_t page_stride;   // elements from one page to the next
} Bf16Rows;

static inline const uint16_t* bf16_row(const Bf16Rows* rows, int64_t j) {
    if (!rows->pages) return rows->base + j * rows->stride;
    const int64_t page = rows->pages[j / rows->page_size];
    return rows->base + page * rows->page_stride + (j % rows->page_size) * rows->stride;
}

// The rows of stream or cache slots `kv` (`stride` elements apart) for one KV head: slot rows
// with a page table, where each page holds page_size rows of all heads.
static inline Bf16Rows slot_rows(const uint16_t* kv, int64_t first_row, int64_t stride,
                                 int64_t kv_head, int64_t head_dim, const int64_t* pages,
                                 int64_t page_size) {
    const Bf16Rows rows = {kv + first_row * stride + kv_head * head_dim, stride, pages,
                           page_size, page_size * stride};
    return rows;
}

// Keys as the dot-product instructions read them (VDPBF16PS's and AMX's B operand): blocks of
// 16 keys, each [head_dim / 2 pairs of dims][16 keys][2 dims], 32 * head_dim bytes in one run.
// A cache that keeps its keys packed holds per page and KV head page_size / 16 such blocks:
// [page][KV head][block][pair][16][2], so no kernel transposes them at every step.
#define KEYS_PER_PACKED_BLOCK 16

// The blocks of one KV head's keys in a packed cache, as rows: row b is keys 16b..16b+15.
static inline Bf16Rows packed_key_blocks(const uint16_t* k, int64_t kv_head,
                                         int64_t num_kv_heads, int64_t head_dim,
                                         const int64_t* pages, int64_t page_size) {
    const int64_t block = KEYS_PER_PACKED_BLOCK * head_dim;
    const Bf16Rows rows = {k + kv_head * page_size * head_dim, block, pages,
                           page_size / KEYS_PER_PACKED_BLOCK,
                           num_kv_heads * page_size * head_dim};
    return rows;
}

// Where a task's sequence stands: its keys, the position of its query 0 when causal, how many
// keys the task's last query sees, and where its keys lie (a page table, or the first stream
// row of its keys).
typedef struct {
    int64_t n_k, first_position, n_seen;
    const int64_t* pages;  // NULL for stream rows
    int64_t first_row;     // 0 with pages
} TaskKeys;

static inline TaskKeys task_keys(Task task, const int64_t* cu_q, const int64_t* cu_k,
                                 const int64_t* page_tables, int64_t pages_stride, int causal) {
    TaskKeys keys;
    const int64_t n_q = cu_q[task.seq + 1] - cu_q[task.seq];
    keys.n_k = cu_k[task.seq + 1] - cu_k[task.seq];
    keys.first_position = keys.n_k - n_q;
    keys.n_seen = causal ? keys.first_position + task.query_end : keys.n_k;
    keys.pages = page_tables ? page_tables + task.seq * pages_stride : NULL;
    keys.first_row = keys.pages ? 0 : cu_k[task.seq];
    if (task.num_keys) {  // a split of a decode: its own pages, all of them visible
        keys.n_k = keys.n_seen = task.num_keys;
        keys.first_position = keys.n_k - n_q;
        keys.pages += task.first_page;
    }
    return keys;
}

// The keys of each split of a task's decode (whole pages each), or 0 where it stays whole:
// tasks of one query over pages, split where too few tasks would keep `threads` threads busy.
static inline int64_t split_length(Task task, const int64_t* cu_q, const int64_t* cu_k,
                                   int64_t num_tasks, int64_t page_size, int threads) {
    if (cu_q[task.seq + 1] - cu_q[task.seq] != 1) return 0;
    const int64_t n_k = cu_k[task.seq + 1] - cu_k[task.seq];
    const int64_t splits = splits_for(n_k, num_tasks, threads);
    const int64_t keys = ((n_k + splits - 1) / splits + page_size - 1) / page_size * page_size;
    return keys < n_k ? keys : 0;
}

// Splits the keys of the decodes among the tasks (split_length), each split a task of its own
// that writes a partial result (its outputs and log-sum-exps) for merging. Returns the tasks,
// a new array where any was split (the old one freed; on running out of memory the tasks stay
// whole), and sets *num_partials to the number of splits.
static Task* split_decodes(Task* tasks, int64_t* num_tasks, const int64_t* cu_q,
                           const int64_t* cu_k, int64_t page_size, int threads,
                           int64_t* num_partials) {
    *num_partials = 0;
    int64_t total = 0;
    for (int64_t i = 0; i < *num_tasks; ++i) {
        const int64_t keys = split_length(tasks[i], cu_q, cu_k, *num_tasks, page_size, threads);
        const int64_t n_k = cu_k[tasks[i].seq + 1] - cu_k[tasks[i].seq];
        total += keys ? (n_k + keys - 1) / keys : 1;
    }
    Task* split = total == *num_tasks ? NULL : malloc(sizeof(Task) * total);
    if (!split) return tasks;
    int64_t t = 0;
    for (int64_t i = 0; i < *num_tasks; ++i) {
        const Task task = tasks[i];
        const int64_t keys = split_length(task, cu_q, cu_k, *num_tasks, page_size, threads);
        if (!keys) {
            split[t++] = task;
            continue;
        }
        const int64_t n_k = cu_k[task.seq + 1] - cu_k[task.seq];
        for (int64_t first = 0; first < n_k; first += keys, ++t) {
            split[t] = task;
            split[t].first_page = first / page_size;
            split[t].num_keys = n_k - first < keys ? n_k - first : keys;
            split[t].partial = (*num_partials)++;
        }
    }
    free(tasks);
    *num_tasks = total;
    return split;
}

#endif
