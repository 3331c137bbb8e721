/* Sets the logits a token bitmask forbids to -inf, in place, on the CPU.
 *
 * The bitmask is what grammar engines fill: per row, 32-bit words whose bit j allows token
 * 32 * w + j. A dense PyTorch version expands the bits into a [rows, vocab] boolean mask and
 * runs masked_fill over every logit, several passes over G1's 64 x 151,936 logits per step
 * (about as long as the step's argmax). Here a word of all ones (every token allowed: most of
 * a JSON string's words) is skipped without touching its logits, a zero word (all banned: most
 * of a JSON structural state's) is 32 stores, and only mixed words walk their bits.
 *
 * Portable C (no vector intrinsics): the work is bound by the stores, not arithmetic.
 */
#include <stdint.h>

/* logits: [rows, vocab] elements of element_size bytes (2: bf16 / fp16, 4: fp32), row_stride
 * elements apart; bitmask: [rows, words_per_row] int32; minus_inf: the dtype's -inf bits. */
void apply_token_bitmask(void *logits, int64_t rows, int64_t vocab, int64_t row_stride,
                         int element_size, uint32_t minus_inf, const uint32_t *bitmask,
                         int64_t words_per_row, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const uint32_t *words = bitmask + row * words_per_row;
        for (int64_t w = 0; w < words_per_row; w++) {
            uint32_t word = words[w];
            if (word == 0xFFFFFFFFu) continue;
            int64_t first = w * 32;
            if (first >= vocab) break;
            uint32_t banned = ~word;
            if (vocab - first < 32) banned &= (1u << (vocab - first)) - 1u;
            if (element_size == 2) {
                uint16_t *out = (uint16_t *)logits + row * row_stride + first;
                for (; banned; banned &= banned - 1u) out[__builtin_ctz(banned)] = (uint16_t)minus_inf;
            } else {
                uint32_t *out = (uint32_t *)logits + row * row_stride + first;
                for (; banned; banned &= banned - 1u) out[__builtin_ctz(banned)] = minus_inf;
            }
        }
    }
}
