"""Attention for bf16 models on x86 CPUs: every prefill through the C varlen kernel.

A packed prefill-only batch (corpus jobs: embeddings, scoring, classification) is one kernel
call over the whole token stream, with no padding and no per-sequence calls. In engine steps
each prefill segment, fresh or a chunk over its cached pages, is one call; decodes keep the
portable paged matmuls of the SDPA backend, which this backend extends.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from vacpack.attention.backend import BatchLayout, register_backend
from vacpack.attention.torch_sdpa import SdpaMetadata, TorchSdpaBackend
from vacpack.cpu_kernels import varlen_attention
from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class PackedPrefill:
    """A batch of whole sequences without a KV cache."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64: sequence b is stream rows [b] to [b + 1]
    causal: bool


class CpuKernelBackend(TorchSdpaBackend):
    name = "cpu_kernels"

    def build_metadata(
        self, layout: BatchLayout, device: torch.device
    ) -> SdpaMetadata | PackedPrefill:
        if layout.page_tables:
            return super().build_metadata(layout, device)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(layout.query_lens)], dtype=torch.int64)
        return PackedPrefill(cu_seqlens, layout.causal)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: SdpaMetadata | PackedPrefill,
    ) -> torch.Tensor:
        if isinstance(metadata, PackedPrefill):
            cu_seqlens = metadata.cu_seqlens
            return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=metadata.causal)
        return super().forward(q, k, v, kv_layer, metadata)

    def _prefill_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        # The kernel aligns causal attention bottom-right, as `mask` does for cached keys.
        cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int64)
        cu_k = torch.tensor([0, keys.shape[0]], dtype=torch.int64)
        return varlen_attention(q, keys, values, cu_q, cu_k, causal=causal)


register_backend(CpuKernelBackend.name, CpuKernelBackend)
