"""Attention for bf16 models on x86 CPUs, all of it in the C kernel (vacpack/cpu_kernels).

A packed prefill-only batch (corpus jobs: embeddings, scoring, classification) is one kernel
call over the whole token stream: no padding, no per-sequence calls. An engine step is one
call too: after its new keys and values are written to the cache, decodes, fresh prefills and
prefill chunks over cached pages all read their keys straight from the cache's pages, so
nothing is gathered or padded.

Decodes whose page tables start with the same pages (a cached prefix, as prefix caching leaves
a shared system prompt) run as a cascade: the step's call covers only their own pages, a second
call attends every group's query rows to its prefix at once (the prefix's keys packed once per
group and KV head instead of once per sequence), and the two parts merge by log-sum-exp.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vacpack.attention.backend import AttentionBackend, BatchLayout, register_backend
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY, CascadePolicy, merge_by_lse
from vacpack.attention.shared_prefix import shared_decode_prefixes
from vacpack.attention.torch_sdpa import build_slot_mapping
from vacpack.cpu_kernels import paged_attention, paged_attention_with_lse, varlen_attention
from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class PackedPrefill:
    """A batch of whole sequences without a KV cache."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64: sequence b is stream rows [b] to [b + 1]
    causal: bool


@dataclass(frozen=True)
class PagedSequences:
    """Queries over paged keys, as paged_attention takes them."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] each sequence's query rows
    context_lens: torch.Tensor  # [num_seqs] keys each sequence attends to
    page_tables: torch.Tensor  # [num_seqs, max_pages] int64, padded with page 0


@dataclass(frozen=True)
class PrefixCascade:
    """Groups of decodes sharing prefix pages: group g is one sequence of the `prefixes` call
    whose queries are the stream rows rows[cu_seqlens_q[g]:cu_seqlens_q[g + 1]]."""

    rows: torch.Tensor  # [members] stream rows of the grouped decodes
    prefixes: PagedSequences  # each group's shared pages; its members see all of them


@dataclass(frozen=True)
class PagedStep:
    """An engine step over the paged cache."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's keys and values are written
    sequences: PagedSequences  # every sequence; cascade members over their own pages only
    page_size: int
    cascade: PrefixCascade | None


def _cumulative(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


def _paged_sequences(
    query_lens: Sequence[int], context_lens: Sequence[int], page_tables: Sequence[Sequence[int]]
) -> PagedSequences:
    padded = torch.zeros(len(page_tables), max(map(len, page_tables)), dtype=torch.int64)
    for row, pages in enumerate(page_tables):
        padded[row, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
    return PagedSequences(
        _cumulative(query_lens), torch.tensor(context_lens, dtype=torch.int64), padded
    )


class CpuKernelBackend(AttentionBackend):
    name = "cpu_kernels"

    def __init__(self, cascade: CascadePolicy | None = DEFAULT_CASCADE_POLICY) -> None:
        self.cascade = cascade  # None: every decode reads its whole context itself

    def build_metadata(
        self, layout: BatchLayout, device: torch.device
    ) -> PackedPrefill | PagedStep:
        if not layout.page_tables:
            return PackedPrefill(_cumulative(layout.query_lens), layout.causal)
        page_size = layout.page_size
        page_tables = [list(pages) for pages in layout.page_tables]
        context_lens = list(layout.context_lens)
        prefixes = []
        if self.cascade is not None and layout.num_decodes > 1:
            num_decodes = layout.num_decodes
            prefixes = shared_decode_prefixes(
                page_tables[:num_decodes],
                context_lens[:num_decodes],
                page_size,
                self.cascade.min_prefix_tokens,
                self.cascade.min_saved_tokens,
            )
        cascade = None
        if prefixes:
            for prefix in prefixes:
                for i in prefix.members:  # decode i is stream row i
                    page_tables[i] = page_tables[i][prefix.num_pages :]
                    context_lens[i] -= prefix.num_pages * page_size
            cascade = PrefixCascade(
                rows=torch.tensor([i for p in prefixes for i in p.members], dtype=torch.int64),
                prefixes=_paged_sequences(
                    [len(p.members) for p in prefixes],
                    [p.num_pages * page_size for p in prefixes],
                    [layout.page_tables[p.members[0]][: p.num_pages] for p in prefixes],
                ),
            )
        return PagedStep(
            slot_mapping=build_slot_mapping(layout),
            sequences=_paged_sequences(layout.query_lens, context_lens, page_tables),
            page_size=page_size,
            cascade=cascade,
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
        cache = (kv_layer.keys, kv_layer.values)
        seqs, page_size = metadata.sequences, metadata.page_size
        paged = (seqs.cu_seqlens_q, seqs.context_lens, seqs.page_tables, page_size)
        if metadata.cascade is None:
            return paged_attention(q, *cache, *paged)
        out, lse = paged_attention_with_lse(q, *cache, *paged)
        rows, prefixes = metadata.cascade.rows, metadata.cascade.prefixes
        prefix_out, prefix_lse = paged_attention_with_lse(
            q.index_select(0, rows),
            *cache,
            prefixes.cu_seqlens_q,
            prefixes.context_lens,
            prefixes.page_tables,
            page_size,
            causal=False,
        )
        merged = merge_by_lse(
            prefix_out, prefix_lse, out.index_select(0, rows), lse.index_select(0, rows)
        )
        return out.index_copy_(0, rows, merged)


register_backend(CpuKernelBackend.name, CpuKernelBackend)
