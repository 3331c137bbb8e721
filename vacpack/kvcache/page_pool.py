"""The KV pages: who holds each one, and which hold a reusable prefix (automatic prefix caching).

Every page has a reference count: the number of running sequences whose page table holds it.
With prefix caching on, a page that a sequence has filled completely is indexed by a chained
hash of its content (its tokens and the hash of the page before it), so the same tokens after
the same prefix always map to the same key. When its count drops to zero such a page is not
freed but kept, still indexed, in least-recently-used order: a later request with that prefix
takes it back instead of recomputing it. Pages are evicted (their index entry dropped) only
when a fresh page is needed and no unindexed free page is left.

Whole pages are shared, never partial ones, so no page is ever written by two sequences: a
sequence writes only into pages past its cached prefix, which it owns alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class OutOfPagesError(RuntimeError):
    pass


@dataclass
class PrefixCacheStats:
    num_queried_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # of those, found cached
    num_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def describe(self) -> str:
        return (
            f"prefix cache hit rate {self.hit_rate:.1%} ({self.num_hit_tokens} of "
            f"{self.num_queried_tokens} prompt tokens), {self.num_evictions} evictions"
        )


def page_hashes(
    token_ids: Sequence[int], page_size: int, parent_hash: int | None = None
) -> list[int]:
    """Chained hashes of the full pages of `token_ids` (a trailing partial page has none)."""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent_hash = hash((parent_hash, tuple(token_ids[start : start + page_size])))
        hashes.append(parent_hash)
    return hashes


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        # A stack: the most recently freed page is reused first, while it is warm in caches.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref_counts = [0] * num_pages
        self._page_by_hash: dict[int, int] = {}
        self._hash_by_page: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ counts
    @property
    def num_free_pages(self) -> int:
        """Pages a sequence can get now: free ones plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    # ------------------------------------------------------------------ plain pages
    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > self.num_free_pages:
            raise OutOfPagesError(f"asked for {num_pages} pages, {self.num_free_pages} free")
        pages = []
        for _ in range(num_pages):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_by_hash[self._hash_by_page.pop(page)]
                self.stats.num_evictions += 1
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page; the last reference frees it or keeps it cached."""
        # Released in reverse, so that a sequence's first pages (the prefix other requests are
        # most likely to share) are the last to be evicted.
        for page in reversed(pages):
            self._ref_counts[page] -= 1
            if self._ref_counts[page] > 0:
                continue
            if page in self._hash_by_page:
                self._evictable[page] = None
            else:
                self._free.append(page)

    # ------------------------------------------------------------------ prefix caching
    def match_prefix(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Takes a reference to the cached pages of the longest cached run of `hashes` (chained
        page hashes of a sequence of `num_tokens` tokens) and returns them, in order."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for page_hash in hashes:
            page = self._page_by_hash.get(page_hash)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._ref_counts[page] == 0:
                del self._evictable[page]
            self._ref_counts[page] += 1
        self.stats.num_queried_tokens += num_tokens
        self.stats.num_hit_tokens += len(pages) * self.page_size
        return pages

    def num_cached_prefix_pages(self, hashes: Sequence[int]) -> int:
        """How many of these chained page hashes, from the first on, are cached (no side effect)."""
        count = 0
        for page_hash in hashes:
            if page_hash not in self._page_by_hash:
                break
            count += 1
        return count

    def register(self, page: int, page_hash: int) -> None:
        """Indexes a page its sequence has just filled completely."""
        if not self.enable_prefix_caching or page in self._hash_by_page:
            return
        if page_hash in self._page_by_hash:
            return  # the same content is already cached in another page: keep that one
        self._page_by_hash[page_hash] = page
        self._hash_by_page[page] = page_hash

    def forget_prefixes(self) -> None:
        """Drops every cached prefix: unreferenced cached pages become free pages, and pages
        still held are freed, not cached, when their holders let go."""
        self._free.extend(reversed(self._evictable))  # the least recently used reused last
        self._evictable.clear()
        self._page_by_hash.clear()
        self._hash_by_page.clear()

    def check_consistency(self) -> None:
        """Raises AssertionError when the bookkeeping contradicts itself (tests call this)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & evictable, "a page is both free and cached"
        for page in range(self.num_pages):
            count = self._ref_counts[page]
            assert count >= 0, f"page {page} has a negative reference count"
            assert (count == 0) == (page in free or page in evictable), f"page {page} misfiled"
        assert evictable <= set(self._hash_by_page), "an evictable page is not indexed"
        assert all(self._page_by_hash[h] == p for p, h in self._hash_by_page.items())
