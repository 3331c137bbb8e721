"""The attention backend interface: what a model layer needs from an attention implementation.

A step's tokens form one ragged 1-D stream. The runner describes it once per step as a
`BatchLayout`; the backend turns that into its own metadata (index tensors, masks, kernel
arguments) once, and every layer's `forward` reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class BatchLayout:
    """The sequences of one step, in stream order.

    Sequence i contributes `query_lens[i]` consecutive tokens to the stream. After this step its
    KV cache holds `context_lens[i]` tokens (those computed before plus these queries), stored in
    the pages `page_tables[i]`. Sequences with one query token (decodes) come first.
    `page_tables` is empty when the step runs without a KV cache (a packed prefill-only forward).
    `causal` False makes every token see its whole sequence (encoders such as BERT); it is only
    meaningful without a KV cache.
    """

    query_lens: Sequence[int]
    context_lens: Sequence[int]
    page_tables: Sequence[Sequence[int]] = ()
    page_size: int = 0
    causal: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_decodes(self) -> int:
        return sum(1 for n in self.query_lens if n == 1)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> Any:
        """Everything the layers need for this step, built once on the host and moved once."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: Any,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

        Writes k and v into `kv_layer` (when there is one) and returns the attention output
        shaped like q: each token attends to its own sequence's earlier tokens only.
        """


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def create_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
