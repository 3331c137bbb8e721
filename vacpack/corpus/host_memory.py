"""How much host memory a piece of work allocates at its peak, sampled while it runs.

The process's peak resident size (ru_maxrss) cannot say this: it is the peak since the process
started, which loading the model usually set, so a probe forward that stays below it reads as
0 bytes; and freed memory that the allocator hands out again never shows up in the resident
size at all. glibc's own count of bytes in use (`mallinfo2`) rises with every tensor a forward
allocates, whichever memory backs it, so sampling it while the work runs gives its peak
(approximately: an allocation that lives for less than a sampling interval can be missed).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from types import TracebackType

from vacpack.host_allocator import load_libc

SAMPLE_INTERVAL_S = 0.0005


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _glibc_bytes_in_use_reader() -> Callable[[], int] | None:
    """Bytes allocated and not yet freed, heap and mmap together; None without glibc >= 2.33."""
    mallinfo2 = getattr(load_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2

    def read() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return read


_read_bytes_in_use = _glibc_bytes_in_use_reader()


def can_measure() -> bool:
    return _read_bytes_in_use is not None


class PeakAllocation:
    """`with PeakAllocation() as peak: work()`, then `peak.bytes`: the most allocated at once
    during the work, above what was allocated when it started (0 where it cannot be measured)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="vacpack-peak-allocation")
        self._baseline_bytes = 0

    def __enter__(self) -> PeakAllocation:
        if _read_bytes_in_use is not None:
            self._baseline_bytes = _read_bytes_in_use()
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if _read_bytes_in_use is not None:
            self._stop.set()
            self._thread.join()

    def _sample(self) -> None:
        assert _read_bytes_in_use is not None  # started only when it can read
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.bytes = max(self.bytes, _read_bytes_in_use() - self._baseline_bytes)
