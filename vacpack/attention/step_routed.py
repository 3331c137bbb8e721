"""Engine steps routed by kind: decode-only steps to one backend, steps with prefill to another.

Which attention implementation is fastest depends on the step. On an Intel Xeon with AMX,
PyTorch's flash SDPA (oneDNN's AMX micro-kernels) runs prefill chunks 2.5-3x faster than the C
kernels, while the C paged kernel still reads a decode batch's pages fastest; on an AMD EPYC
the C kernels win both. Measured selection (selection.py) times the candidates on a decode
batch and on a prefill step apart, and where they disagree the engine runs this backend.

Both backends read and write the same paged KV cache (every paged backend of a device uses the
cache's one layout), so a sequence's pages may be written by one and read by the other. A step
that mixes decodes with prefill chunks goes to the prefill backend: its work is the chunks'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vacpack.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    DecodeGraphBuffers,
)
from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class RoutedMetadata:
    backend: AttentionBackend  # the one that runs this step
    metadata: Any  # its metadata for the step


class StepRoutedBackend(AttentionBackend):
    def __init__(self, *, decode: AttentionBackend, prefill: AttentionBackend) -> None:
        self.decode = decode
        self.prefill = prefill
        self.name = f"{decode.name} (decodes), {prefill.name} (prefills)"

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return self.decode.unsupported(spec) or self.prefill.unsupported(spec)

    def make_decode_graph_buffers(
        self, max_num_seqs: int, max_pages_per_seq: int, page_size: int, device: torch.device
    ) -> DecodeGraphBuffers | None:
        # A graph replays decode-only steps: those run on the decode backend.
        return self.decode.make_decode_graph_buffers(
            max_num_seqs, max_pages_per_seq, page_size, device
        )

    def packs_keys(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, page_size: int) -> bool:
        # One cache for both: packed only where both read packed keys.
        return self.decode.packs_keys(dtype, kv_cache_dtype, page_size) and self.prefill.packs_keys(
            dtype, kv_cache_dtype, page_size
        )

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> RoutedMetadata:
        decode_only = bool(layout.page_tables) and all(n == 1 for n in layout.query_lens)
        backend = self.decode if decode_only else self.prefill
        return RoutedMetadata(backend, backend.build_metadata(layout, device))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: Any,
        spec: AttentionSpec = FULL_ATTENTION,
    ) -> torch.Tensor:
        # A graph's metadata comes from the decode backend's buffers, not from build_metadata.
        if isinstance(metadata, RoutedMetadata):
            return metadata.backend.forward(q, k, v, kv_layer, metadata.metadata, spec)
        return self.decode.forward(q, k, v, kv_layer, metadata, spec)
