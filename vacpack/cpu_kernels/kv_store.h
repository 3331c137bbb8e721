// Storing a step's new keys and values into a paged KV cache: by packed_keys.c (a store on its
// own), and by the attention kernels (varlen_attention.c, varlen_attention_amx.c,
// varlen_attention_f32.c), which store the step's keys and values as the first phase of the
// call that reads them. An engine step's layer is then one C call where it was three (the
// value store, the key store and the attention), and the threads share the stores. G1's decode
// batch (64 sequences, 24 layers, packed keys, 2-core Zen 4, interleaved): 23.6 -> 22.5 ms a
// step with two threads, 35.5 -> 34.7 ms of CPU time with one; the attention alone took 21.9
// and 33.6. Portable C: the work is scattered stores.

#ifndef VACPACK_KV_STORE_H
#define VACPACK_KV_STORE_H

#include <stdint.h>
#include <string.h>

#define KV_STORE_KEYS_PER_BLOCK 16  // packed_keys.py's KEYS_PER_BLOCK

// Key `row` (num_kv_heads * head_dim bf16, heads side by side) into slot `slot` of one layer's
// packed keys: pair p (dims 2p, 2p+1) of head h goes to its page's block as one 32-bit word,
// [page][h][block][p][key of the block].
static inline void store_packed_key(uint16_t* cache, const uint16_t* row, int64_t slot,
                                    int64_t num_kv_heads, int64_t head_dim, int64_t page_size) {
    const int64_t num_pairs = head_dim / 2;
    const int64_t page = slot / page_size, offset = slot % page_size;
    const int64_t lane = offset % KV_STORE_KEYS_PER_BLOCK;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        uint16_t* head_keys = cache + (page * num_kv_heads + h) * page_size * head_dim;
        uint32_t* block = (uint32_t*)head_keys +
                          (offset / KV_STORE_KEYS_PER_BLOCK) * num_pairs * KV_STORE_KEYS_PER_BLOCK;
        for (int64_t p = 0; p < num_pairs; ++p) {
            uint32_t pair;
            memcpy(&pair, row + h * head_dim + 2 * p, sizeof(pair));
            block[p * KV_STORE_KEYS_PER_BLOCK + lane] = pair;
        }
    }
}

// A step's new keys and values: token t's go to slot slots[t]. Rows of num_kv_heads * head_dim
// elements of the cache's dtype (`element_bytes`), key_stride and value_stride elements apart.
// count 0: nothing to store.
typedef struct {
    const void* keys;
    const void* values;
    const int64_t* slots;
    int64_t count, key_stride, value_stride;
    int64_t num_slots;  // the cache's: every slot must lie below
} NewKV;

// 1 when every slot lies in the cache.
static inline int new_kv_fits(const NewKV* kv) {
    for (int64_t t = 0; t < kv->count; ++t)
        if (kv->slots[t] < 0 || kv->slots[t] >= kv->num_slots) return 0;
    return 1;
}

// Stores `kv` into one layer's cache: keys k (packed, or slot rows `k_stride` elements apart)
// and values v (slot rows). Run by every thread of the caller's parallel region (the loop is
// shared among them) and waited for by all of them before they go on.
static inline void store_new_kv(const NewKV* kv, void* k, void* v, int64_t k_stride,
                                int64_t v_stride, int64_t num_kv_heads, int64_t head_dim,
                                int64_t page_size, int keys_packed, int64_t element_bytes) {
    const int64_t row_bytes = num_kv_heads * head_dim * element_bytes;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < kv->count; ++t) {
        const int64_t slot = kv->slots[t];
        const char* key = (const char*)kv->keys + t * kv->key_stride * element_bytes;
        if (keys_packed)
            store_packed_key(k, (const uint16_t*)key, slot, num_kv_heads, head_dim, page_size);
        else
            memcpy((char*)k + slot * k_stride * element_bytes, key, row_bytes);
        memcpy((char*)v + slot * v_stride * element_bytes,
               (const char*)kv->values + t * kv->value_stride * element_bytes, row_bytes);
    }
}

#endif
