"""Attention on CPUs, all of it in one C kernel call per layer (vacpack/cpu_kernels): bf16
models on x86 CPUs with AVX512-BF16, float32 models on any CPU with a C compiler.

A packed prefill-only batch (corpus jobs: embeddings, scoring, classification) is one kernel
call over the whole token stream: no padding, no per-sequence calls. An engine step is one
call too: it stores the step's new keys and values into the cache, then decodes, fresh
prefills and prefill chunks over cached pages all read their keys straight from the cache's
pages, so nothing is gathered or padded.

Decodes whose page tables start with the same pages (a cached prefix, as prefix caching leaves
a shared system prompt) run as a cascade: the step's call covers only their own pages, a second
call attends every group's query rows to its prefix at once (the prefix's keys packed once per
group and KV head instead of once per sequence), and the two parts merge by log-sum-exp.

A bf16 model's calls run on one of the bf16 kernel's implementations (`bf16_kernel`: AVX-512
registers or AMX tiles, measured in selection.py where a CPU has both), a cascade's prefix call
on its own choice of them (`prefix_bf16_kernel`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vacpack.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
)
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY, CascadePolicy, merge_prefix_into
from vacpack.attention.page_tables import padded_page_table
from vacpack.attention.shared_prefix import shared_decode_prefixes
from vacpack.attention.torch_sdpa import build_slot_mapping
from vacpack.cpu_kernels import (
    DEFAULT_BF16_KERNEL,
    KernelSequences,
    NewKV,
    attend,
    attend_with_lse,
    packed_sequences,
    paged_sequences,
)
from vacpack.cpu_kernels.packed_keys import KEYS_PER_BLOCK
from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class PackedPrefill:
    """A batch of whole sequences without a KV cache: sequence b is stream rows
    cu_seqlens[b] to cu_seqlens[b + 1] for queries and keys alike."""

    sequences: KernelSequences


@dataclass(frozen=True)
class PrefixCascade:
    """Groups of decodes sharing prefix pages: group g is one sequence of the `prefixes` call
    (not causal: its members see all of the prefix) whose queries are the stream rows
    rows[cu_seqlens_q[g]:cu_seqlens_q[g + 1]]."""

    rows: torch.Tensor  # [members] stream rows of the grouped decodes
    prefixes: KernelSequences  # each group's shared pages


@dataclass(frozen=True)
class PagedStep:
    """An engine step over the paged cache."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's keys and values are written
    sequences: KernelSequences  # every sequence; cascade members over their own pages only
    cascade: PrefixCascade | None


def _cumulative(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


def _paged_sequences(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
    causal: bool,
) -> KernelSequences:
    padded = padded_page_table(page_tables, fill_page=0, dtype=torch.int64)
    context = torch.tensor(context_lens, dtype=torch.int64)
    return paged_sequences(_cumulative(query_lens), context, padded, page_size, causal=causal)


class CpuKernelBackend(AttentionBackend):
    name = "cpu_kernels"

    def __init__(
        self,
        cascade: CascadePolicy | None = DEFAULT_CASCADE_POLICY,
        bf16_kernel: str = DEFAULT_BF16_KERNEL,
        prefix_bf16_kernel: str | None = None,
    ) -> None:
        self.cascade = cascade  # None: every decode reads its whole context itself
        self.bf16_kernel = bf16_kernel  # which implementation runs bf16 (BF16_KERNELS)
        # The one that runs a cascade's prefixes (None: bf16_kernel).
        self.prefix_bf16_kernel = prefix_bf16_kernel or bf16_kernel

    def packs_keys(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, page_size: int) -> bool:
        # Both bf16 implementations read keys packed (the float32 kernel does not): a decode's
        # keys then need no transposes (G1's decode batch, 24 layers, 2-core Zen 4,
        # bench/decode_attention.py: 30.6 -> 27.2 ms a step).
        bf16 = dtype == kv_cache_dtype == torch.bfloat16
        return bf16 and page_size % KEYS_PER_BLOCK == 0

    def build_metadata(
        self, layout: BatchLayout, device: torch.device
    ) -> PackedPrefill | PagedStep:
        if not layout.page_tables:
            cu_seqlens = _cumulative(layout.query_lens)
            return PackedPrefill(packed_sequences(cu_seqlens, cu_seqlens, causal=layout.causal))
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
                    page_size,
                    causal=False,
                ),
            )
        return PagedStep(
            slot_mapping=build_slot_mapping(layout),
            sequences=_paged_sequences(
                layout.query_lens, context_lens, page_tables, page_size, causal=True
            ),
            cascade=cascade,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: PackedPrefill | PagedStep,
        spec: AttentionSpec = FULL_ATTENTION,
    ) -> torch.Tensor:
        # The C kernel runs plain causal attention only: a model with sliding windows, another
        # score scale or soft-capping gets another backend (selection.py).
        reason = self.unsupported(spec)
        if reason is not None:
            raise ValueError(reason)
        if isinstance(metadata, PackedPrefill):
            return attend(q, k, v, metadata.sequences, bf16_kernel=self.bf16_kernel)
        if kv_layer is None:
            raise ValueError("an engine step needs its layer's KV cache")
        # The kernel stores the step's keys and values itself, before it attends.
        cache = (kv_layer.keys, kv_layer.values)
        packed = kv_layer.packed_keys
        new_kv = NewKV(metadata.slot_mapping, k, v)
        if metadata.cascade is None:
            return attend(
                q,
                *cache,
                metadata.sequences,
                bf16_kernel=self.bf16_kernel,
                keys_packed=packed,
                new_kv=new_kv,
            )
        out, lse = attend_with_lse(
            q,
            *cache,
            metadata.sequences,
            bf16_kernel=self.bf16_kernel,
            keys_packed=packed,
            new_kv=new_kv,
        )
        rows, prefixes = metadata.cascade.rows, metadata.cascade.prefixes
        prefix_out, prefix_lse = attend_with_lse(
            q.index_select(0, rows),
            *cache,
            prefixes,
            bf16_kernel=self.prefix_bf16_kernel,
            keys_packed=packed,
        )
        return merge_prefix_into(out, lse, rows, prefix_out, prefix_lse)
