"""What every layer of one forward pass shares: the attention backend, its metadata, the cache,
and, for encoders reading text pairs, each token's segment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vacpack.attention.backend import AttentionBackend, AttentionSpec
from vacpack.kvcache.paged_cache import KVLayer, PagedKVCache


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionBackend
    metadata: Any
    kv_cache: PagedKVCache | None  # None for a prefill-only forward that keeps no KV
    # [num_tokens] int64 segment ids (0: first text, 1: second) for a cross-encoder's pairs;
    # None where every token is of type 0.
    token_type_ids: torch.Tensor | None = None
    # [rows] int64: the only rows whose final hidden states are read (a generation step's
    # sampled rows), in the order they are wanted; None for every row. A model that honours it
    # (PackedModel.prunes_output_rows) returns these rows alone.
    output_rows: torch.Tensor | None = None

    def kv_layer(self, index: int) -> KVLayer | None:
        return None if self.kv_cache is None else self.kv_cache.layer(index)


def attention_windows(model: nn.Module) -> tuple[int | None, ...]:
    """The sliding windows of the model's layers (None: full attention), for a BatchLayout:
    encoders and plain decoders attend over everything."""
    return getattr(model.config, "attention_windows", (None,))


def attention_specs(model: nn.Module) -> tuple[AttentionSpec, ...]:
    """How each layer attends, for choosing a backend that can (empty: plain attention)."""
    return getattr(model.config, "attention_specs", ())
