"""The paged KV cache: per-layer key and value tensors cut into fixed-size pages.

Storage is one flat run of token slots per layer (`num_pages * page_size` of them); slot
`page * page_size + offset` holds one token's keys and values. Which pages a request owns is its
page table, kept by the request and the allocator, never by these tensors.
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
        self.keys.index_copy_(0, slot_mapping, keys)
        self.values.index_copy_(0, slot_mapping, values)


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
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def layer(self, index: int) -> KVLayer:
        return KVLayer(self.keys[index], self.values[index], self.page_size)
