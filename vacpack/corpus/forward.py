"""Runs packed bins through a model; documents longer than a bin go through a KV cache in chunks.

A bin needs no KV cache: every document in it is whole, so one forward over the packed stream
(positions restarting at 0 per document, attention kept within each) gives every row's hidden
state. A document longer than a bin runs alone: in one forward when its tokens fit the memory
a forward may use, else as chunked prefill, each chunk writing its keys and values into a
small paged cache that the next chunk attends to. No document is ever cut short.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vacpack.attention.backend import AttentionBackend, BatchLayout
from vacpack.kvcache.paged_cache import PagedKVCache
from vacpack.models.forward_context import ForwardContext, attention_windows
from vacpack.runtime import LoadedModel

CHUNK_PAGE_SIZE = 16


class PackedForward:
    def __init__(self, loaded: LoadedModel, attention: AttentionBackend) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.attention = attention
        self.device = loaded.device
        # Decoders (and their classifiers) are causal; encoders such as BERT say otherwise.
        self.causal = bool(getattr(self.model, "is_causal", True))
        self.attention_windows = attention_windows(self.model)

    @torch.inference_mode()
    def packed(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a bin of whole sequences."""
        layout = BatchLayout(
            list(seq_lens),
            list(seq_lens),
            causal=self.causal,
            attention_windows=self.attention_windows,
        )
        ctx = ForwardContext(
            self.attention, self.attention.build_metadata(layout, self.device), None,
            token_type_ids,
        )  # fmt: skip
        return self.model(token_ids, positions, ctx)

    def long_document(
        self,
        token_ids: torch.Tensor,
        max_forward_tokens: int,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of one document: in one forward if it fits, else in chunks that do."""
        num_tokens = token_ids.numel()
        if num_tokens <= max_forward_tokens:
            positions = torch.arange(num_tokens, device=token_ids.device)
            return self.packed(token_ids, positions, [num_tokens], token_type_ids)
        if not self.causal:
            raise ValueError(
                f"document of {num_tokens} tokens is longer than one forward may hold "
                f"({max_forward_tokens}), and a bidirectional encoder cannot run it in chunks; "
                "ask for truncation"
            )
        return self._chunked(token_ids, max_forward_tokens)

    @torch.inference_mode()
    def _chunked(self, token_ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        """Hidden states of one long causal document, computed chunk by chunk over a KV cache."""
        num_tokens = token_ids.numel()
        config = self.model.config
        num_pages = -(-num_tokens // CHUNK_PAGE_SIZE)
        cache = PagedKVCache(
            config.num_layers, num_pages, CHUNK_PAGE_SIZE, config.num_kv_heads,
            config.head_dim, self.loaded.dtype, self.device,
        )  # fmt: skip
        page_table = list(range(num_pages))
        parts = []
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            layout = BatchLayout(
                [end - start],
                [end],
                [page_table],
                CHUNK_PAGE_SIZE,
                attention_windows=self.attention_windows,
            )
            metadata = self.attention.build_metadata(layout, self.device)
            positions = torch.arange(start, end, device=self.device)
            parts.append(
                self.model(
                    token_ids[start:end], positions, ForwardContext(self.attention, metadata, cache)
                )
            )
        return torch.cat(parts)
