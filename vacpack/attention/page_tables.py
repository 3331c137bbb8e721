"""Page tables as the kernels read them: one padded tensor of page ids, built off the host's
per-sequence Python lists in one pass."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from vacpack.attention.backend import BatchLayout


def padded_page_table(
    tables: Sequence[Sequence[int]], fill_page: int, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """The tables as rows of one tensor, short rows padded with `fill_page`.

    Built through numpy from one flat run of ids: a tensor from nested lists took 2 ms for a
    decode step of 256 sequences on a 2-core EPYC, on the host's critical path, against 0.35 ms
    this way."""
    np_dtype = np.int32 if dtype == torch.int32 else np.int64
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max(initial=0))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np_dtype)
    padded = np.full((len(tables), width), fill_page, dtype=np_dtype)
    padded[np.arange(width)[None, :] < lengths[:, None]] = flat
    return torch.from_numpy(padded)


def used_pages(layout: BatchLayout) -> list[Sequence[int]]:
    """Each sequence's pages that hold its context (a page table may reach further ahead)."""
    page_size = layout.page_size
    return [
        pages[: -(-context_len // page_size)]
        for pages, context_len in zip(layout.page_tables, layout.context_lens, strict=True)
    ]
