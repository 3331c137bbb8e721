"""The decode attention benchmark's workload: Qwen2.5-0.5B's attention shapes, the two decode
batches (g1 and shared_prefix) and how their pages are handed out, and a step's inputs: each
layer's own KV cache, queries and new keys and values."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vacpack.attention.backend import BatchLayout
from vacpack.kvcache.paged_cache import KVLayer

NUM_HEADS = 14
NUM_KV_HEADS = 2
HEAD_DIM = 64
PAGE_SIZE = 16
CPU = torch.device("cpu")


@dataclass(frozen=True)
class DecodeBatch:
    page_tables: list[list[int]]
    context_lens: list[int]
    num_pages: int

    @property
    def layout(self) -> BatchLayout:
        num_seqs = len(self.context_lens)
        return BatchLayout([1] * num_seqs, self.context_lens, self.page_tables, PAGE_SIZE)


def pages_for(num_tokens: int) -> int:
    return -(-num_tokens // PAGE_SIZE)


def make_batch(
    prefix_ids: Sequence[int],
    prefix_len: int,
    prompt_lens: Sequence[int],
    generated: Sequence[int],
) -> DecodeBatch:
    """Sequence i: prefix_len tokens of a prefix it shares with every sequence of the same
    prefix id (page-aligned; 0 for none), then prompt_lens[i] own prompt tokens, then
    generated[i] decoded ones. Pages are handed out as the engine would: each prompt's pages in
    one run at prefill, then decode pages one at a time as the sequences fill theirs."""
    next_page = 0

    def take(count: int) -> list[int]:
        nonlocal next_page
        next_page += count
        return list(range(next_page - count, next_page))

    prefixes = {prefix_id: take(pages_for(prefix_len)) for prefix_id in sorted(set(prefix_ids))}
    tables = [
        prefixes[prefix_id] + take(pages_for(prefix_len + own) - pages_for(prefix_len))
        for prefix_id, own in zip(prefix_ids, prompt_lens, strict=True)
    ]
    context_lens = [prefix_len + own for own in prompt_lens]
    final_lens = [n + g for n, g in zip(context_lens, generated, strict=True)]
    for _ in range(max(generated)):
        for i, table in enumerate(tables):
            if context_lens[i] < final_lens[i]:
                if context_lens[i] == len(table) * PAGE_SIZE:
                    table.extend(take(1))
                context_lens[i] += 1
    return DecodeBatch(tables, context_lens, next_page)


def g1_batch(generator: torch.Generator) -> DecodeBatch:
    num_seqs = 64
    prompts = torch.randint(32, 1025, (num_seqs,), generator=generator).tolist()
    generated = torch.randint(0, 129, (num_seqs,), generator=generator).tolist()
    return make_batch([0] * num_seqs, 0, prompts, generated)


def shared_prefix_batch(generator: torch.Generator) -> DecodeBatch:
    num_seqs = 128
    prompts = torch.randint(32, 129, (num_seqs,), generator=generator).tolist()
    generated = torch.randint(0, 65, (num_seqs,), generator=generator).tolist()
    return make_batch([0] * num_seqs, 1024, prompts, generated)


def long_decodes_batch() -> DecodeBatch:
    """Two long decodes (prompts of 8,000 and 6,000 tokens, 64 generated): fewer tasks (a
    sequence and KV head each) than threads want, so the C kernel splits their keys (split-K)."""
    return make_batch([0, 0], 0, [8000, 6000], [64, 64])


@dataclass(frozen=True)
class Step:
    """One decode step's attention inputs, layer by layer."""

    kv_layers: list[KVLayer]
    queries: list[torch.Tensor]  # [seqs, heads, head_dim] per layer
    new_keys: list[torch.Tensor]  # [seqs, kv_heads, head_dim] per layer
    new_values: list[torch.Tensor]

    def with_cache_in(self, dtype: torch.dtype) -> Step:
        """The same step with each layer's cache converted to `dtype` (bfloat16 under float32
        queries: a cache kept in bf16 for float32 arithmetic)."""
        layers = [
            KVLayer(layer.keys.to(dtype), layer.values.to(dtype), layer.page_size)
            for layer in self.kv_layers
        ]
        return dataclasses.replace(self, kv_layers=layers)


def make_step(
    batch: DecodeBatch, num_layers: int, generator: torch.Generator, dtype: torch.dtype
) -> Step:
    num_seqs = len(batch.context_lens)
    slots = batch.num_pages * PAGE_SIZE

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return Step(
        kv_layers=[
            KVLayer(
                randn(slots, NUM_KV_HEADS, HEAD_DIM),
                randn(slots, NUM_KV_HEADS, HEAD_DIM),
                PAGE_SIZE,
            )
            for _ in range(num_layers)
        ],
        queries=[randn(num_seqs, NUM_HEADS, HEAD_DIM) for _ in range(num_layers)],
        new_keys=[randn(num_seqs, NUM_KV_HEADS, HEAD_DIM) for _ in range(num_layers)],
        new_values=[randn(num_seqs, NUM_KV_HEADS, HEAD_DIM) for _ in range(num_layers)],
    )
