"""One engine step for attention backend tests: a decode and a 300-token prefill, each over its
own pages of a random KV cache (bf16 unless asked), the prefill optionally after cached
tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vacpack.attention import BatchLayout
from vacpack.kvcache.paged_cache import KVLayer, PagedKVCache

PAGE_SIZE = 16
PREFILL_LEN = 300
DECODE_CONTEXT = 20


@dataclass(frozen=True)
class MixedStep:
    layer: KVLayer
    layout: BatchLayout
    q: torch.Tensor  # [1 + PREFILL_LEN, heads, dim]: the decode's row, then the prefill's
    k: torch.Tensor
    v: torch.Tensor
    context_len: int  # the prefill's keys after this step: cached tokens + PREFILL_LEN
    prefill_slots: torch.Tensor  # [context_len] the cache slots of the prefill's keys, in order


def mixed_step(
    cached_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> MixedStep:
    generator = torch.Generator().manual_seed(seed)
    context_len = cached_tokens + PREFILL_LEN
    decode_pages = list(range(-(-DECODE_CONTEXT // PAGE_SIZE)))
    num_pages = len(decode_pages) + -(-context_len // PAGE_SIZE)
    prefill_pages = list(range(len(decode_pages), num_pages))
    cache = PagedKVCache(1, num_pages, PAGE_SIZE, num_kv_heads, head_dim, dtype, "cpu")
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    layout = BatchLayout(
        [1, PREFILL_LEN],
        [DECODE_CONTEXT, context_len],
        [decode_pages, prefill_pages],
        PAGE_SIZE,
    )

    def rand(count: int) -> torch.Tensor:
        shape = (1 + PREFILL_LEN, count, head_dim)
        return torch.randn(shape, generator=generator).to(dtype)

    slots = torch.tensor(
        [p * PAGE_SIZE + i for p in prefill_pages for i in range(PAGE_SIZE)][:context_len]
    )
    return MixedStep(
        cache.layer(0),
        layout,
        rand(num_heads),
        rand(num_kv_heads),
        rand(num_kv_heads),
        context_len,
        slots,
    )
