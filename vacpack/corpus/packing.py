"""Packs whole documents into padding-free bins under a token budget, first-fit decreasing.

A bin is one 1-D token stream holding several documents back to back, with `cu_seqlens`
boundaries and positions that restart at 0 for every document: the layout the varlen attention
kernels read. Documents are never cut; one longer than the budget goes out alone, flagged
`oversize`, for the runner to chunk through a KV cache.

Streaming: documents are read in windows of `window_docs`, so a corpus of any size is packed with
bounded memory. Each window is sorted longest first and placed first-fit; its bins are emitted
once the whole window is placed, except the `carry_open_bins` least-full ones, which stay open for
the next window to fill (a bin is carried at most once, so no document waits more than one extra
window and the job's reordering buffer stays bounded too).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

TokenIdArray = npt.NDArray[np.int64]

PADDING_DOC_INDEX = -1


@dataclass(frozen=True, eq=False, init=False)
class Document:
    """One whole document of a corpus job.

    `token_ids` is stored as a contiguous 1-D int64 numpy array: packing copies it into the bin's
    stream with one slice assignment, and the bin becomes a torch tensor without another copy. A
    list, tuple or CPU tensor is accepted and converted once, here, which is in the caller's
    reading/tokenizing iterator and so off the critical path when that runs in `BackgroundBins`.
    The packer never writes to the array.
    """

    index: int  # position in the input, to put results back in order
    token_ids: TokenIdArray
    payload: Any = None  # opaque to the packer; whatever the job needs back with the result

    def __init__(
        self,
        index: int,
        token_ids: TokenIdArray | Sequence[int] | torch.Tensor,
        payload: Any = None,
    ) -> None:
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "token_ids", _as_token_id_array(token_ids, index))
        object.__setattr__(self, "payload", payload)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class DocumentError:
    """A document that cannot be packed (an empty one); passed through so the job goes on."""

    index: int
    message: str


@dataclass(frozen=True, eq=False)
class PackedBin:
    """Whole documents back to back in one token stream; alignment padding is its own segment."""

    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, restarting at 0 for every segment
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32
    seq_lens: tuple[int, ...]  # one per segment
    doc_indices: tuple[int, ...]  # one per segment; PADDING_DOC_INDEX for a padding segment
    documents: tuple[Document | None, ...]  # one per segment; None for a padding segment
    num_tokens: int  # including padding
    num_padding_tokens: int
    oversize: bool = False  # one document longer than the budget, alone and never padded

    @property
    def num_segments(self) -> int:
        return len(self.seq_lens)

    @property
    def num_documents(self) -> int:
        return self.num_segments - self.doc_indices.count(PADDING_DOC_INDEX)


PackerOutput = PackedBin | DocumentError


@dataclass(eq=False)  # compared by identity
class _OpenBin:
    free_tokens: int
    documents: list[Document] = field(default_factory=list)
    carried: bool = False  # already carried over once; emitted after this window whatever its fill


class FirstFitDecreasingPacker:
    """Streams documents into `PackedBin`s (and `DocumentError`s for empty documents).

    Outputs come out in this order: an error or an oversize bin as soon as its document is read;
    the bins of a window, in the order they were opened, as soon as the window is placed.
    At most `window_docs` documents plus the documents of `carry_open_bins` bins are held at once.
    """

    def __init__(
        self,
        budget_tokens: int,
        window_docs: int,
        align_to: int | None = None,
        pad_token_id: int = 0,
        carry_open_bins: int = 1,
    ) -> None:
        if budget_tokens < 1:
            raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
        if window_docs < 1:
            raise ValueError(f"window_docs must be >= 1, got {window_docs}")
        if align_to is not None and align_to < 1:
            raise ValueError(f"align_to must be >= 1 or None, got {align_to}")
        if align_to is not None and budget_tokens % align_to != 0:
            # Otherwise a document that fits the budget could have a slot that does not.
            raise ValueError(
                f"budget_tokens ({budget_tokens}) must be a multiple of align_to ({align_to})"
            )
        if carry_open_bins < 0:
            raise ValueError(f"carry_open_bins must be >= 0, got {carry_open_bins}")
        self.budget_tokens = budget_tokens
        self.window_docs = window_docs
        self.align_to = align_to
        self.pad_token_id = pad_token_id
        self.carry_open_bins = carry_open_bins

    def slot_tokens(self, num_tokens: int) -> int:
        """Tokens a document of `num_tokens` takes in a bin, alignment padding included."""
        if self.align_to is None:
            return num_tokens
        return -(-num_tokens // self.align_to) * self.align_to

    def pack(self, documents: Iterable[Document | DocumentError]) -> Iterator[PackerOutput]:
        """Error records in `documents` (a document the reader could not tokenize) pass through
        in order, so the job keeps going for the others."""
        window: list[Document] = []
        carried_bins: list[_OpenBin] = []
        for document in documents:
            if isinstance(document, DocumentError):
                yield document
            elif document.num_tokens == 0:
                yield DocumentError(document.index, f"document {document.index} has no tokens")
            elif document.num_tokens > self.budget_tokens:
                yield self._build_bin([document], oversize=True)
            else:
                window.append(document)
                if len(window) == self.window_docs:
                    finished_bins, carried_bins = self._place_window(window, carried_bins)
                    yield from (self._build_bin(b.documents) for b in finished_bins)
                    window = []
        finished_bins, _ = self._place_window(window, carried_bins, carry_open_bins=0)
        yield from (self._build_bin(b.documents) for b in finished_bins)

    def _place_window(
        self,
        window: Sequence[Document],
        carried_bins: list[_OpenBin],
        carry_open_bins: int | None = None,
    ) -> tuple[list[_OpenBin], list[_OpenBin]]:
        """First-fit decreasing over `carried_bins` (first, as the oldest) and new bins.

        Returns the bins to emit, in opening order, and the bins to carry into the next window.
        """
        # Python's sort is stable even with reverse=True: equal slots keep input order, so the
        # result is deterministic.
        ordered = sorted(window, key=lambda d: self.slot_tokens(d.num_tokens), reverse=True)
        bins = list(carried_bins)
        # Free tokens per bin in one array so that "first bin with room" is one vectorised scan.
        free_tokens = np.empty(len(bins) + len(ordered), dtype=np.int64)
        free_tokens[: len(bins)] = [b.free_tokens for b in bins]
        for document in ordered:
            slot = self.slot_tokens(document.num_tokens)
            fits = free_tokens[: len(bins)] >= slot
            bin_index = int(fits.argmax()) if bins else 0
            if not bins or not fits[bin_index]:
                bin_index = len(bins)
                bins.append(_OpenBin(free_tokens=self.budget_tokens))
                free_tokens[bin_index] = self.budget_tokens
            free_tokens[bin_index] -= slot
            bins[bin_index].documents.append(document)
        for open_bin, free in zip(bins, free_tokens[: len(bins)].tolist(), strict=True):
            open_bin.free_tokens = free

        num_to_carry = self.carry_open_bins if carry_open_bins is None else carry_open_bins
        candidates = [b for b in bins if not b.carried and b.free_tokens > 0]
        # Least full first; ties go to the older bin (stable sort).
        candidates.sort(key=lambda b: b.free_tokens, reverse=True)
        to_carry = candidates[:num_to_carry]
        for open_bin in to_carry:
            open_bin.carried = True
        return [b for b in bins if b not in to_carry], to_carry

    def _build_bin(self, documents: Sequence[Document], oversize: bool = False) -> PackedBin:
        seq_lens: list[int] = []
        doc_indices: list[int] = []
        segment_documents: list[Document | None] = []
        for document in documents:
            seq_lens.append(document.num_tokens)
            doc_indices.append(document.index)
            segment_documents.append(document)
            num_padding_tokens = (
                0 if oversize else self.slot_tokens(document.num_tokens) - document.num_tokens
            )
            if num_padding_tokens > 0:
                seq_lens.append(num_padding_tokens)
                doc_indices.append(PADDING_DOC_INDEX)
                segment_documents.append(None)

        seq_lens_array = np.asarray(seq_lens, dtype=np.int64)
        cu_seqlens = np.zeros(len(seq_lens) + 1, dtype=np.int64)
        np.cumsum(seq_lens_array, out=cu_seqlens[1:])
        num_tokens = int(cu_seqlens[-1])

        # Prefilled with the pad id, so only the documents' spans need writing.
        token_ids = np.full(num_tokens, self.pad_token_id, dtype=np.int64)
        for start, segment in zip(cu_seqlens[:-1].tolist(), segment_documents, strict=True):
            if segment is not None:
                token_ids[start : start + segment.num_tokens] = segment.token_ids
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            cu_seqlens[:-1], seq_lens_array
        )
        num_padding_tokens = num_tokens - sum(d.num_tokens for d in documents)
        return PackedBin(
            token_ids=torch.from_numpy(token_ids),
            positions=torch.from_numpy(positions),
            cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
            seq_lens=tuple(seq_lens),
            doc_indices=tuple(doc_indices),
            documents=tuple(segment_documents),
            num_tokens=num_tokens,
            num_padding_tokens=num_padding_tokens,
            oversize=oversize,
        )


def _as_token_id_array(token_ids: Any, index: int) -> TokenIdArray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray) and token_ids.dtype.kind not in "iu":
        raise ValueError(f"document {index}: token_ids must be integers, got {token_ids.dtype}")
    array = np.ascontiguousarray(token_ids, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"document {index}: token_ids must be 1-D, got shape {array.shape}")
    return array
