"""The KV pages of sequences: reserving them, giving them back, sharing cached prefixes.

With prefix caching, a sequence admitted (or re-admitted after preemption) first takes the cached
pages of its longest cached prefix and computes only the rest; after each step the pages it has
filled are indexed for others. Pages a running sequence is computing right now are announced as
"in flight", so that a waiting sequence whose next uncached page is one of them can wait for it
instead of computing it a second time.
"""

from __future__ import annotations

from vacpack.engine.request import Sequence
from vacpack.engine.window_pages import WindowedPageRelease, held_pages
from vacpack.kvcache.page_pool import PagePool


class PageManager:
    def __init__(self, pool: PagePool, page_size: int, kv_window: int | None = None) -> None:
        self.pool = pool
        self.page_size = page_size
        # Every layer has a sliding window: pages behind the largest are freed as sequences go.
        self._window_release = (
            None if kv_window is None else WindowedPageRelease(kv_window, page_size)
        )
        # Hashes of the full pages running sequences are computing and have not indexed yet,
        # with how many sequences compute each.
        self._pages_in_flight: dict[int, int] = {}

    def reserve(self, sequence: Sequence, num_tokens: int) -> bool:
        """Gives the sequence pages for its first `num_tokens` tokens; False when too few are
        free (then nothing is taken)."""
        num_needed = -(-num_tokens // self.page_size) - len(sequence.page_table)
        if num_needed <= 0:
            return True
        if num_needed > self.pool.num_free_pages:
            return False
        sequence.page_table.extend(self.pool.allocate(num_needed))
        return True

    def release(self, sequence: Sequence) -> None:
        """Gives all the sequence's pages back; its computed tokens must be computed again."""
        for page_hash in list(sequence.in_flight_hashes):
            self._landed(sequence, page_hash)
        self.pool.free(held_pages(sequence))
        sequence.page_table = []
        sequence.num_released_pages = 0
        sequence.page_hashes = []
        sequence.num_computed_tokens = 0

    def release_dead_pages(self, sequence: Sequence) -> None:
        """Frees the pages no layer's sliding window reaches any more (window_pages.py)."""
        if self._window_release is not None:
            self._window_release.release_dead_pages(sequence, self.pool)

    def take_cached_prefix(self, sequence: Sequence) -> None:
        """Starts a sequence without pages on the cached pages of its longest cached prefix."""
        if sequence.page_table:
            return
        hashes = self._cacheable_page_hashes(sequence)
        pages = self.pool.match_prefix(hashes, sequence.num_tokens)
        sequence.page_table = pages
        sequence.page_hashes = hashes[: len(pages)]
        sequence.num_computed_tokens = len(pages) * self.page_size
        if sequence.num_output_tokens == 0:
            sequence.num_cached_prompt_tokens = sequence.num_computed_tokens

    def next_page_in_flight(self, sequence: Sequence) -> bool:
        """True when the first page the sequence would compute is being computed by another."""
        if not self.pool.enable_prefix_caching or not self._pages_in_flight:
            return False
        hashes = self._cacheable_page_hashes(sequence)
        num_cached = self.pool.num_cached_prefix_pages(hashes)
        return num_cached < len(hashes) and hashes[num_cached] in self._pages_in_flight

    def announce_in_flight(self, sequence: Sequence) -> None:
        """Marks the full pages the sequence is about to compute, so others wait for them."""
        if not self.pool.enable_prefix_caching:
            return
        hashes = sequence.full_page_hashes(self.page_size)[len(sequence.page_hashes) :]
        sequence.in_flight_hashes = set(hashes)
        for page_hash in sequence.in_flight_hashes:
            self._pages_in_flight[page_hash] = self._pages_in_flight.get(page_hash, 0) + 1

    def register_computed_pages(self, sequence: Sequence) -> None:
        """Indexes the pages the sequence has filled completely, for others to reuse."""
        if not self.pool.enable_prefix_caching:
            return
        num_full_pages = sequence.num_computed_tokens // self.page_size
        num_hashed = len(sequence.page_hashes)
        if num_full_pages <= num_hashed:
            return
        new_hashes = sequence.full_page_hashes(self.page_size)[num_hashed:num_full_pages]
        for offset, page_hash in enumerate(new_hashes):
            self.pool.register(sequence.page_table[num_hashed + offset], page_hash)
            sequence.page_hashes.append(page_hash)
            self._landed(sequence, page_hash)

    def _cacheable_page_hashes(self, sequence: Sequence) -> list[int]:
        max_pages = sequence.max_cached_tokens // self.page_size
        return sequence.full_page_hashes(self.page_size)[:max_pages]

    def _landed(self, sequence: Sequence, page_hash: int) -> None:
        """The sequence has indexed (or given up) a page it announced."""
        if page_hash not in sequence.in_flight_hashes:
            return
        sequence.in_flight_hashes.discard(page_hash)
        count = self._pages_in_flight.pop(page_hash)
        if count > 1:
            self._pages_in_flight[page_hash] = count - 1
