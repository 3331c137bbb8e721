"""The paged KV cache: per-layer key and value tensors cut into fixed-size pages.

Storage is one flat run of token slots per layer; slot `page * page_size + offset` holds one
token's keys and values. Which pages a request owns is its page table, kept by the request and
the allocator, never by these tensors.

One page beyond the `num_pages` the allocator hands out is the scratch page: a batch padded to a
fixed shape (a captured CUDA graph) writes its dummy rows' keys and values there, where no
sequence reads them.

A cache may keep its keys packed: each page's keys of a KV head as blocks of 16 keys with pairs
of dims side by side ([page, KV head, block, dim pair, 16 keys, 2 dims];
vacpack/cpu_kernels/packed_keys.py), the operand layout of the CPU's bf16 dot-product
instructions. The CPU attention kernels then read a decode's keys in place, 2 KiB runs per page
and head of 64 dims, where from token rows they transpose every key at every step (G1's decode
batch on a 2-core Zen 4: 30.6 -> 27.2 ms a step). Which layout a cache has is the attention
backend's choice (AttentionBackend.packs_keys): readers that index slots (torch, Triton) take
token rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.packed_keys import packed_key_shape, read_packed_keys, store_packed_keys


@dataclass(frozen=True)
class KVLayer:
    """One layer's key and value slots. Values are [num_slots, num_kv_heads, head_dim]; keys
    too, or with packed_keys [num_pages, num_kv_heads, page_size / 16, head_dim / 2, 16, 2]."""

    keys: torch.Tensor
    values: torch.Tensor
    page_size: int
    packed_keys: bool = False

    @property
    def num_kv_heads(self) -> int:
        return self.values.shape[1]

    @property
    def head_dim(self) -> int:
        return self.values.shape[2]

    def key_rows(self) -> torch.Tensor:
        """The keys as slots [num_slots, num_kv_heads, head_dim], for readers that index them."""
        if self.packed_keys:
            raise ValueError(
                "this KV cache keeps its keys packed for the CPU attention kernels; an attention "
                "backend that reads slots needs a cache of token rows"
            )
        return self.keys

    def write(self, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores a step's keys and values, rounded to the cache's dtype where it is
        narrower than the model's."""
        if self.packed_keys:
            store_packed_keys(self.keys, slot_mapping, keys)
        else:
            self.keys.index_copy_(0, slot_mapping, keys.to(self.keys.dtype))
        self.values.index_copy_(0, slot_mapping, values.to(self.values.dtype))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `slots`, gathered, in `dtype` (the attention's)."""
        if self.packed_keys:
            keys = read_packed_keys(self.keys, slots)
        else:
            keys = self.keys.index_select(0, slots)
        return keys.to(dtype), self.values.index_select(0, slots).to(dtype)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        packed_keys: bool = False,
    ) -> None:
        self.num_pages = num_pages  # pages for sequences, numbered 0 .. num_pages - 1
        self.page_size = page_size
        self.scratch_page = num_pages
        self.packed_keys = packed_keys
        slots = (num_layers, (num_pages + 1) * page_size, num_kv_heads, head_dim)
        key_shape: tuple[int, ...] = slots
        if packed_keys:
            layer = packed_key_shape(num_pages + 1, page_size, num_kv_heads, head_dim)
            key_shape = (num_layers, *layer)
        self.keys = torch.zeros(key_shape, dtype=dtype, device=device)
        self.values = torch.zeros(slots, dtype=dtype, device=device)

    @property
    def scratch_slot(self) -> int:
        return self.scratch_page * self.page_size

    @property
    def num_bytes(self) -> int:
        """Bytes of the pages that hold sequences (the one scratch page is not counted)."""
        bytes_per_slot = self.values[:, 0].numel() * self.values.element_size()  # all layers
        return 2 * self.num_pages * self.page_size * bytes_per_slot

    def layer(self, index: int) -> KVLayer:
        return KVLayer(self.keys[index], self.values[index], self.page_size, self.packed_keys)
