/* Stores a step's keys into a cache that keeps them packed (packed_keys.py, varlen_tasks.h):
 * each pair of a key's dims as one 32-bit word of its page's block (kv_store.h). PyTorch's
 * index_put_ on a permuted view of the cache made writing a 64-sequence decode step's keys and
 * values 2.6x slower than into token rows; with this loop it is 1.2x. The CPU attention kernels
 * store an engine step's keys the same way themselves, as their call's first phase.
 */
#include <stdint.h>

#include "kv_store.h"

/* cache: one layer's packed keys, bf16 (2-byte elements); keys: [num_tokens] rows of
 * num_kv_heads * head_dim bf16, key_stride elements apart; slots: where each token goes. */
void store_packed_keys(uint16_t *cache, const uint16_t *keys, const int64_t *slots,
                       int64_t num_tokens, int64_t key_stride, int64_t num_kv_heads,
                       int64_t head_dim, int64_t page_size) {
    for (int64_t t = 0; t < num_tokens; ++t)
        store_packed_key(cache, keys + t * key_stride, slots[t], num_kv_heads, head_dim,
                         page_size);
}
