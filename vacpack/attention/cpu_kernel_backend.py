"""Attention for bf16 models on x86 CPUs, all of it in the C kernel (vacpack/cpu_kernels).

A packed prefill-only batch (corpus jobs: embeddings, scoring, classification) is one kernel
call over the whole token stream: no padding, no per-sequence calls. An engine step is one
call too: after its new keys and values are written to the cache, decodes, fresh prefills and
prefill chunks over cached pages all read their keys straight from the cache's pages, so
nothing is gathered or padded. Shared prefixes are read once per sequence (no cascade): the
kernel reads pages in place faster than the portable cascade path gathers them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from vacpack.attention.backend import AttentionBackend, BatchLayout, register_backend
from vacpack.attention.torch_sdpa import build_slot_mapping
from vacpack.cpu_kernels import paged_attention, varlen_attention
from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class PackedPrefill:
    """A batch of whole sequences without a KV cache."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64: sequence b is stream rows [b] to [b + 1]
    causal: bool


@dataclass(frozen=True)
class PagedStep:
    """An engine step over the paged cache."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's keys and values are written
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] each sequence's rows of the stream
    context_lens: torch.Tensor  # [num_seqs] tokens in the cache after this step
    page_tables: torch.Tensor  # [num_seqs, max_pages] int64, padded with page 0
    page_size: int


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


class CpuKernelBackend(AttentionBackend):
    name = "cpu_kernels"

    def build_metadata(
        self, layout: BatchLayout, device: torch.device
    ) -> PackedPrefill | PagedStep:
        if not layout.page_tables:
            return PackedPrefill(_cumulative(list(layout.query_lens)), layout.causal)
        max_pages = max(map(len, layout.page_tables))
        page_tables = torch.zeros(len(layout.page_tables), max_pages, dtype=torch.int64)
        for row, pages in enumerate(layout.page_tables):
            page_tables[row, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        return PagedStep(
            slot_mapping=build_slot_mapping(layout),
            cu_seqlens_q=_cumulative(list(layout.query_lens)),
            context_lens=torch.tensor(layout.context_lens, dtype=torch.int64),
            page_tables=page_tables,
            page_size=layout.page_size,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: PackedPrefill | PagedStep,
    ) -> torch.Tensor:
        if isinstance(metadata, PackedPrefill):
            cu_seqlens = metadata.cu_seqlens
            return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=metadata.causal)
        if kv_layer is None:
            raise ValueError("an engine step needs its layer's KV cache")
        kv_layer.write(metadata.slot_mapping, k, v)
        return paged_attention(
            q,
            kv_layer.keys,
            kv_layer.values,
            metadata.cu_seqlens_q,
            metadata.context_lens,
            metadata.page_tables,
            metadata.page_size,
        )


register_backend(CpuKernelBackend.name, CpuKernelBackend)
