/* Stores a step's keys into a cache that keeps them packed (packed_keys.py, varlen_tasks.h).
 *
 * Key pair p (dims 2p, 2p+1) of token t, KV head h, goes to its page's block as one 32-bit word:
 * [page][h][block][p][key of the block]. PyTorch's index_put_ on a permuted view of the cache
 * made writing a 64-sequence decode step's keys and values 2.6x slower than into token rows;
 * with this loop it is 1.2x. Portable C: the work is scattered 4-byte stores.
 */
#include <stdint.h>
#include <string.h>

#define KEYS_PER_BLOCK 16

/* cache: one layer's packed keys, bf16 (2-byte elements); keys: [num_tokens] rows of
 * num_kv_heads * head_dim bf16, key_stride elements apart; slots: where each token goes. */
void store_packed_keys(uint16_t *cache, const uint16_t *keys, const int64_t *slots,
                       int64_t num_tokens, int64_t key_stride, int64_t num_kv_heads,
                       int64_t head_dim, int64_t page_size) {
    const int64_t num_pairs = head_dim / 2;
    const int64_t block_words = num_pairs * KEYS_PER_BLOCK;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t page = slots[t] / page_size, offset = slots[t] % page_size;
        const int64_t lane = offset % KEYS_PER_BLOCK;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            uint16_t *head_keys = cache + (page * num_kv_heads + h) * page_size * head_dim;
            uint32_t *block = (uint32_t *)head_keys + (offset / KEYS_PER_BLOCK) * block_words;
            const uint16_t *row = keys + t * key_stride + h * head_dim;
            for (int64_t p = 0; p < num_pairs; ++p) {
                uint32_t pair;
                memcpy(&pair, row + 2 * p, sizeof(pair));
                block[p * KEYS_PER_BLOCK + lane] = pair;
            }
        }
    }
}
