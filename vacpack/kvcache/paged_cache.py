"""The paged KV cache: per-layer key and value tensors cut into fixed-size pages.

Storage is one flat run of token slots per layer; slot `page * page_size + offset` holds one
token's keys and values. Which pages a request owns is its page table, kept by the request and
the allocator, never by these tensors.

One page beyond the `num_pages` the allocator hands out is the scratch page: a batch padded to a
fixed shape (a captured CUDA graph) writes its dummy rows' keys and values there, where no
sequence reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayer:
    """One layer's key and value slots: [num_slots, num_kv_heads, head_dim] each."""

    keys: torch.Tensor
    values: torch.Tensor
    page_size: int

    def write(self, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores a step's keys and values, rounded to the cache's dtype where it is
        narrower than the model's."""
        self.keys.index_copy_(0, slot_mapping, keys.to(self.keys.dtype))
        self.values.index_copy_(0, slot_mapping, values.to(self.values.dtype))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of `slots`, gathered, in `dtype` (the attention's)."""
        keys = self.keys.index_select(0, slots).to(dtype)
        return keys, self.values.index_select(0, slots).to(dtype)


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
    ) -> None:
        self.num_pages = num_pages  # pages for sequences, numbered 0 .. num_pages - 1
        self.page_size = page_size
        self.scratch_page = num_pages
        shape = (num_layers, (num_pages + 1) * page_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def scratch_slot(self) -> int:
        return self.scratch_page * self.page_size

    @property
    def num_bytes(self) -> int:
        """Bytes of the pages that hold sequences (the one scratch page is not counted)."""
        bytes_per_slot = self.keys[:, 0].numel() * self.keys.element_size()  # all layers' keys
        return 2 * self.num_pages * self.page_size * bytes_per_slot

    def layer(self, index: int) -> KVLayer:
        return KVLayer(self.keys[index], self.values[index], self.page_size)
