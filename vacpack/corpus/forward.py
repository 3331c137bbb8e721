"""Runs packed bins through a model; documents longer than a bin go through a KV cache in chunks.

A bin needs no KV cache: every document in it is whole, so one forward over the packed stream
(positions restarting at 0 per document, attention kept within each) gives every row's hidden
state. A document longer than a bin runs alone: in one forward when its tokens fit the memory
a forward may use, else as chunked prefill, each chunk writing its keys and values into a
small paged cache that the next chunk attends to. No document is ever cut short.

With tensor parallelism rank 0 runs both as programs: PACKED_FORWARD (payload: the number of
sequences, whether token types follow, the sequence lengths) and LONG_DOCUMENT (payload: the
tokens one forward may hold, whether token types follow, the number of tokens); the token ids
(positions, token types) then go to every rank in one device broadcast, and each rank runs the
same forward on its shard (`run_as_worker`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vacpack.attention.backend import AttentionBackend, BatchLayout
from vacpack.distributed.control import Program
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

    def packed(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a bin of whole sequences."""
        driver = self.loaded.driver
        if driver is None:
            return self._packed(token_ids, positions, seq_lens, token_type_ids)
        payload = [len(seq_lens), token_type_ids is not None, *seq_lens]
        with driver.program(Program.PACKED_FORWARD, payload):
            self._share([token_ids, positions, token_type_ids])
            return self._packed(token_ids, positions, seq_lens, token_type_ids)

    def long_document(
        self,
        token_ids: torch.Tensor,
        max_forward_tokens: int,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of one document: in one forward if it fits, else in chunks that do."""
        num_tokens = token_ids.numel()
        if num_tokens > max_forward_tokens and not self.causal:
            raise ValueError(
                f"document of {num_tokens} tokens is longer than one forward may hold "
                f"({max_forward_tokens}), and a bidirectional encoder cannot run it in chunks; "
                "ask for truncation"
            )
        driver = self.loaded.driver
        if driver is None:
            return self._long_document(token_ids, max_forward_tokens, token_type_ids)
        payload = [max_forward_tokens, token_type_ids is not None, num_tokens]
        with driver.program(Program.LONG_DOCUMENT, payload):
            self._share([token_ids, token_type_ids])
            return self._long_document(token_ids, max_forward_tokens, token_type_ids)

    def run_as_worker(self, kind: Program, payload: list[int]) -> None:
        """A rank other than 0: the program rank 0 announced, on this rank's shard."""
        if kind == Program.PACKED_FORWARD:
            num_seqs, has_types = payload[:2]
            seq_lens = payload[2 : 2 + num_seqs]
            rows = self._receive(sum(seq_lens), 2 + has_types)
            self._packed(rows[0], rows[1], seq_lens, rows[2] if has_types else None)
        else:
            max_forward_tokens, has_types, num_tokens = payload
            rows = self._receive(num_tokens, 1 + has_types)
            self._long_document(rows[0], max_forward_tokens, rows[1] if has_types else None)

    def _share(self, rows: list[torch.Tensor | None]) -> None:
        """Rank 0: the int64 rows (None ones left out) to every rank, in one broadcast."""
        assert self.loaded.tp.collectives is not None
        stacked = torch.stack([row.to(torch.int64) for row in rows if row is not None])
        self.loaded.tp.collectives.broadcast(stacked)

    def _receive(self, num_tokens: int, num_rows: int) -> torch.Tensor:
        """The other ranks: rank 0's rows, [num_rows, num_tokens]."""
        assert self.loaded.tp.collectives is not None
        stacked = torch.empty(num_rows, num_tokens, dtype=torch.int64, device=self.device)
        self.loaded.tp.collectives.broadcast(stacked)
        return stacked

    @torch.inference_mode()
    def _packed(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
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

    def _long_document(
        self,
        token_ids: torch.Tensor,
        max_forward_tokens: int,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        num_tokens = token_ids.numel()
        if num_tokens <= max_forward_tokens:
            positions = torch.arange(num_tokens, device=token_ids.device)
            return self._packed(token_ids, positions, [num_tokens], token_type_ids)
        return self._chunked(token_ids, max_forward_tokens)

    @torch.inference_mode()
    def _chunked(self, token_ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        """Hidden states of one long causal document, computed chunk by chunk over a KV cache."""
        num_tokens = token_ids.numel()
        config = self.model.config
        num_pages = -(-num_tokens // CHUNK_PAGE_SIZE)
        dtype, kv_cache_dtype = self.loaded.dtype, self.loaded.kv_cache_dtype
        cache = PagedKVCache(
            config.num_layers, num_pages, CHUNK_PAGE_SIZE, self.loaded.num_kv_heads,
            config.head_dim, kv_cache_dtype, self.device,
            packed_keys=self.attention.packs_keys(dtype, kv_cache_dtype, CHUNK_PAGE_SIZE),
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
