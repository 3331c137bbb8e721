"""What every layer of one forward pass shares: the attention backend, its metadata, the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vacpack.attention.backend import AttentionBackend
from vacpack.kvcache.paged_cache import KVLayer, PagedKVCache


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionBackend
    metadata: Any
    kv_cache: PagedKVCache | None  # None for a prefill-only forward that keeps no KV

    def kv_layer(self, index: int) -> KVLayer | None:
        return None if self.kv_cache is None else self.kv_cache.layer(index)
