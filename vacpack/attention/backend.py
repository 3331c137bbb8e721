"""The attention backend interface: what a model layer needs from an attention implementation.

A step's tokens form one ragged 1-D stream. The runner describes it once per step as a
`BatchLayout`; the backend turns that into its own metadata (index tensors, masks, kernel
arguments) once, and every layer's `forward` reuses it.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends, beyond causal softmax(q k^T / sqrt(head_dim)) v.

    sliding_window: a query sees itself and the sliding_window - 1 tokens before it (None: its
    whole context). scale: the factor on q k^T (None: head_dim ** -0.5). logit_softcap: scores
    pass through cap * tanh(scores / cap) before the softmax (Gemma 2).
    """

    sliding_window: int | None = None
    scale: float | None = None
    logit_softcap: float | None = None

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale


FULL_ATTENTION = AttentionSpec()


@dataclass(frozen=True)
class BatchLayout:
    """The sequences of one step, in stream order.

    Sequence i contributes `query_lens[i]` consecutive tokens to the stream. After this step its
    KV cache holds `context_lens[i]` tokens (those computed before plus these queries), stored in
    the pages `page_tables[i]`. Sequences with one query token (decodes) come first.
    `page_tables` is empty when the step runs without a KV cache (a packed prefill-only forward).
    `causal` False makes every token see its whole sequence (encoders such as BERT); it is only
    meaningful without a KV cache. `attention_windows` lists the sliding windows the model's
    layers use (None: full attention), so that a backend whose metadata depends on the window
    builds it once per step for each.
    """

    query_lens: Sequence[int]
    context_lens: Sequence[int]
    page_tables: Sequence[Sequence[int]] = ()
    page_size: int = 0
    causal: bool = True
    attention_windows: tuple[int | None, ...] = (None,)

    # Cached: read several times a step, and each count walks every sequence.
    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @functools.cached_property
    def num_decodes(self) -> int:
        return sum(1 for n in self.query_lens if n == 1)


class DecodeGraphBuffers(ABC):
    """Decode metadata in tensors of fixed shape and address, for a captured CUDA graph.

    A graph replays the kernels it captured with the arguments they had, so a decode step's
    metadata must live in the same tensors every step: `fill` rewrites their contents in place,
    and `metadata` views their first rows as the backend's metadata for a batch of that size.
    """

    @abstractmethod
    def metadata(self, num_seqs: int) -> Any:
        """Metadata over the first `num_seqs` rows; views of the same tensors on every call."""

    @abstractmethod
    def fill(self, layout: BatchLayout, num_seqs: int, scratch_page: int) -> None:
        """Writes a decode-only layout into the first `num_seqs` rows.

        Rows past the layout's sequences are padding: their one token writes its keys and values
        to the first slot of `scratch_page` and attends to that slot alone (context length 1),
        so they touch no sequence's pages and never divide by an empty softmax.
        """


class AttentionBackend(ABC):
    name: str

    def unsupported(self, spec: AttentionSpec) -> str | None:
        """Why this backend cannot run a layer that attends as `spec` says; None when it can.
        A backend that overrides nothing runs plain causal attention only."""
        if spec == FULL_ATTENTION:
            return None
        return f"{self.name} runs plain causal attention only, not {describe_spec(spec)}"

    def make_decode_graph_buffers(
        self, max_num_seqs: int, max_pages_per_seq: int, page_size: int, device: torch.device
    ) -> DecodeGraphBuffers | None:
        """Static decode metadata for CUDA graphs; None when this backend cannot be captured
        (its metadata has shapes that change from step to step)."""
        return None

    def packs_keys(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, page_size: int) -> bool:
        """Whether the paged KV cache this backend reads keeps its keys packed
        (vacpack/kvcache/paged_cache.py); a backend that overrides nothing reads token rows."""
        return False

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
        spec: AttentionSpec = FULL_ATTENTION,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

        Writes k and v into `kv_layer` (when there is one) and returns the attention output
        shaped like q: each token attends to its own sequence's earlier tokens only, as `spec`
        says (which `unsupported` has accepted).
        """


def describe_spec(spec: AttentionSpec) -> str:
    parts = []
    if spec.sliding_window is not None:
        parts.append(f"a sliding window of {spec.sliding_window} tokens")
    if spec.scale is not None:
        parts.append(f"a score scale of {spec.scale:.6g}")
    if spec.logit_softcap is not None:
        parts.append(f"score soft-capping at {spec.logit_softcap:g}")
    return " and ".join(parts) or "full attention"  # causal or not: the workload says
