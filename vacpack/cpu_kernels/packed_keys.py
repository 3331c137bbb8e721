"""Keys packed as the CPU's bf16 dot-product instructions read them.

VDPBF16PS (AVX512-BF16) multiplies pairs of bf16 and sums each pair into a float32 lane; AMX's
TDPBF16PS takes its B operand in the same form. For a score product q . k over 16 keys at once,
an operand is one pair of dims of 16 keys side by side: [16 keys][2 dims], 64 bytes. A block of
16 keys is then [head_dim / 2 pairs][16 keys][2 dims]: 32 * head_dim bytes in one run.

A paged KV cache may keep its keys this way (vacpack/kvcache/paged_cache.py): per page and KV
head, page_size / 16 blocks, [page, KV head, block, pair, 16, 2]. The C kernels (varlen_tasks.h)
then read a decode's keys in place instead of transposing every key at every step.
"""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.token_rows import rows_of_heads

KEYS_PER_BLOCK = 16  # varlen_tasks.h's KEYS_PER_PACKED_BLOCK

# cache, keys, slots, tokens, key row stride, KV heads, head dim, page size
_ARGTYPES = [*[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 5]


def packed_key_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """The shape of one layer's packed keys: [page, KV head, block, dim pair, 16 keys, 2]."""
    if page_size % KEYS_PER_BLOCK or head_dim % 2:
        raise ValueError(
            f"packed keys need pages of a multiple of {KEYS_PER_BLOCK} slots and an even head "
            f"size, got page_size={page_size}, head_dim={head_dim}"
        )
    blocks = page_size // KEYS_PER_BLOCK
    return (num_pages, num_kv_heads, blocks, head_dim // 2, KEYS_PER_BLOCK, 2)


def pack_keys(keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """Key slots [num_slots, num_kv_heads, head_dim] (whole pages) in the packed layout."""
    num_slots, num_kv_heads, head_dim = keys.shape
    if num_slots % page_size:
        raise ValueError(f"{num_slots} slots are not whole pages of {page_size}")
    pages, _, blocks, pairs, _, _ = packed_key_shape(
        num_slots // page_size, page_size, num_kv_heads, head_dim
    )
    by_block = keys.reshape(pages, blocks, KEYS_PER_BLOCK, num_kv_heads, pairs, 2)
    return by_block.permute(0, 3, 1, 4, 2, 5).contiguous()


def unpack_keys(packed: torch.Tensor) -> torch.Tensor:
    """All slots [num_slots, num_kv_heads, head_dim] of packed keys (pack_keys undone), copied."""
    pages, num_kv_heads, blocks, pairs, keys_per_block, _ = packed.shape
    slots = pages * blocks * keys_per_block
    return packed.permute(0, 2, 4, 1, 3, 5).reshape(slots, num_kv_heads, 2 * pairs)


def _store_kernel() -> KernelFunction | None:
    return kernel_function("packed_keys", "store_packed_keys", _ARGTYPES, portable=True)


def store_packed_keys(packed: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Writes keys [num_tokens, num_kv_heads, head_dim] to `slots` of one layer's packed keys
    (in their dtype), in place: in C on a CPU (packed_keys.c), else by indexing."""
    _, num_kv_heads, blocks, pairs, keys_per_block, _ = packed.shape
    page_size = blocks * keys_per_block
    kernel = _store_kernel() if packed.device.type == "cpu" else None
    if kernel is not None and packed.element_size() == 2 and packed.is_contiguous():
        keys = rows_of_heads(keys.to(packed.dtype))
        slots = slots.to(torch.int64).contiguous()
        num_tokens = keys.shape[0]
        kernel(packed.data_ptr(), keys.data_ptr(), slots.data_ptr(), num_tokens,
               keys.stride(0), num_kv_heads, 2 * pairs, page_size)  # fmt: skip
        return
    pairs_of_keys = keys.to(packed.dtype).reshape(-1, num_kv_heads, pairs, 2)
    _by_slot(packed).index_put_(_slot_index(slots, page_size), pairs_of_keys)


def read_packed_keys(packed: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The keys of `slots` [num_slots, num_kv_heads, head_dim], gathered from packed keys."""
    _, num_kv_heads, blocks, pairs, keys_per_block, _ = packed.shape
    gathered = _by_slot(packed)[_slot_index(slots, blocks * keys_per_block)]
    return gathered.reshape(slots.numel(), num_kv_heads, 2 * pairs)


def _by_slot(packed: torch.Tensor) -> torch.Tensor:
    """Packed keys viewed as [page, block, key of the block, KV head, dim pair, 2]."""
    return packed.permute(0, 2, 4, 1, 3, 5)


def _slot_index(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, ...]:
    """Where slots lie in _by_slot: (page, block, key of the block)."""
    offsets = slots % page_size
    return (slots // page_size, offsets // KEYS_PER_BLOCK, offsets % KEYS_PER_BLOCK)
