"""Hands out free KV pages and takes them back."""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # A stack: the most recently freed page is reused first, while it is still warm in cache.
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free_pages):
            raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free_pages)} free")
        if num_pages == 0:
            return []
        pages = self._free_pages[-num_pages:]
        del self._free_pages[-num_pages:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free_pages.extend(reversed(pages))
