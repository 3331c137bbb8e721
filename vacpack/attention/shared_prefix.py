"""Which decodes share a run of leading KV pages (a cached prefix), found from their page tables.

With prefix caching, requests that start with the same tokens hold the same physical pages for
them, so a shared prefix shows as equal leading page ids. Sorting the page tables puts sequences
with a common prefix next to each other, and the common pages of neighbours (their LCP) describe
the whole prefix tree: the sequences sharing at least `depth` pages are runs of the sorted order
whose neighbour LCPs are all >= depth.

Cascade attention reads a shared prefix once for all its sequences, so a group of `seqs`
sequences sharing `pages` pages saves `(seqs - 1) * pages` page reads. Each sequence joins at most
one group (one level of cascade); the grouping chosen maximises the pages saved over the tree.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SharedPrefix:
    members: tuple[int, ...]  # indices of the sequences sharing it
    num_pages: int  # leading pages they all hold


def find_shared_prefixes(
    page_tables: Sequence[Sequence[int]],
    shareable_pages: Sequence[int],
    min_pages: int,
    min_saved_pages: int = 1,
) -> list[SharedPrefix]:
    """Groups of two or more sequences sharing at least min_pages leading pages, each group
    saving at least min_saved_pages page reads.

    Only the first shareable_pages[i] pages of sequence i may be shared (its full pages before
    the token being decoded, so that its own part is never empty).
    """
    # A group shares at least one page, so only sequences whose first page another one holds
    # too can join one: on a step without shared prefixes (the common case) nothing is left to
    # sort, where sorting every decode's page list cost ~1 ms of host time a step for 256.
    min_shared = max(min_pages, 1)
    eligible = [i for i in range(len(page_tables)) if shareable_pages[i] >= min_shared]
    holders = collections.Counter(page_tables[i][0] for i in eligible)
    candidates = [i for i in eligible if holders[page_tables[i][0]] > 1]
    order = sorted(candidates, key=lambda i: list(page_tables[i][: shareable_pages[i]]))
    # common[j]: leading pages that sorted sequences j and j + 1 share.
    common = [
        _common_prefix_len(
            page_tables[a], page_tables[b], min(shareable_pages[a], shareable_pages[b])
        )
        for a, b in itertools.pairwise(order)
    ]
    _, spans = _best_grouping(common, 0, len(order), min_pages, min_saved_pages)
    return [SharedPrefix(tuple(order[lo:hi]), min(common[lo : hi - 1])) for lo, hi in spans]


def shared_decode_prefixes(
    page_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    page_size: int,
    min_prefix_tokens: int,
    min_saved_tokens: int,
) -> list[SharedPrefix]:
    """find_shared_prefixes over decodes (one query token each, `context_lens` counting it),
    thresholds in tokens: only pages wholly before a decode's newest token are shared, so its
    own part is never empty."""
    return find_shared_prefixes(
        page_tables,
        [(n - 1) // page_size for n in context_lens],
        min_pages=-(-min_prefix_tokens // page_size),
        min_saved_pages=-(-min_saved_tokens // page_size),
    )


def _common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading entries a and b share, up to limit: a binary search over slice
    comparisons, which run in C, instead of a Python loop over up to thousands of pages."""
    if a[:limit] == b[:limit]:
        return limit
    equal, differ = 0, limit  # a[:equal] == b[:equal], a[:differ] != b[:differ]
    while differ - equal > 1:
        middle = (equal + differ) // 2
        if a[:middle] == b[:middle]:
            equal = middle
        else:
            differ = middle
    return equal


def _best_grouping(
    common: list[int], lo: int, hi: int, min_pages: int, min_saved_pages: int
) -> tuple[int, list[tuple[int, int]]]:
    """The pages saved and the chosen groups (spans of the sorted order) within [lo, hi).

    Either the whole span is one group, sharing its smallest LCP, or it splits where that
    smallest LCP occurs, each part grouped on its own: the better of the two. Each split
    deepens the LCP, so the recursion is no deeper than the longest page table.
    """
    if hi - lo < 2:
        return 0, []
    depth = min(common[lo : hi - 1])
    whole = (hi - lo - 1) * depth
    if depth < min_pages or whole < min_saved_pages:
        whole = 0
    saved, spans, start = 0, [], lo
    for j in range(lo, hi):
        if j == hi - 1 or common[j] == depth:
            part_saved, part_spans = _best_grouping(
                common, start, j + 1, min_pages, min_saved_pages
            )
            saved += part_saved
            spans += part_spans
            start = j + 1
    if whole > 0 and whole >= saved:
        return whole, [(lo, hi)]
    return saved, spans
