"""Giving back the KV pages of a sequence that no layer will read again (sliding windows).

When every layer of a model attends over a sliding window of at most `window` tokens, the query
at position p reads keys from position p - window + 1 on, and later queries read later ones. So
once a sequence's next query is at position p, its pages wholly before p - window + 1 are dead:
they go back to the pool, and their page-table entries become RELEASED_PAGE, which keeps the
table's positions aligned (page i still covers tokens i * page_size ...) while no attention
backend ever reads an entry before its window. A model with any full-attention layer keeps
every page.

With prefix caching only pages already indexed by their content hash go back, so they stay in
the cache as a reusable prefix (a page is indexed after the step that fills it; with async
scheduling that is a step after it may already be dead).

Pages released while a launched step still reads them are safe: a later step that reuses them
runs after it on the device, as with any freed page (see step_executor).
"""

from __future__ import annotations

from dataclasses import dataclass

from vacpack.engine.request import Sequence
from vacpack.kvcache.page_pool import PagePool

RELEASED_PAGE = -1


@dataclass(frozen=True)
class WindowedPageRelease:
    window: int  # tokens any layer reads back from a query, itself included (the largest)
    page_size: int

    def release_dead_pages(self, sequence: Sequence, pool: PagePool) -> None:
        """Frees the sequence's pages before the window of its next query."""
        first_read_position = sequence.num_computed_tokens - self.window + 1
        num_dead = max(0, first_read_position) // self.page_size
        if pool.enable_prefix_caching:
            num_dead = min(num_dead, len(sequence.page_hashes))
        start = sequence.num_released_pages
        if num_dead <= start:
            return
        pool.free(sequence.page_table[start:num_dead])
        sequence.page_table[start:num_dead] = [RELEASED_PAGE] * (num_dead - start)
        sequence.num_released_pages = num_dead


def held_pages(sequence: Sequence) -> list[int]:
    """The pages the sequence still holds a reference to."""
    return sequence.page_table[sequence.num_released_pages :]
