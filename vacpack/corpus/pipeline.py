"""Runs packing (and the reading and tokenizing inside its document iterator) ahead of the device.

`BackgroundBins(packer.pack(documents))` drives the packer's lazy iterator in a producer thread,
which keeps up to `max_ready_bins` bins in a bounded queue ahead of the consumer. Because the
packer pulls documents from the caller's iterator, reading and tokenizing run in that thread too.

A thread rather than a process: fast tokenizers and numpy release the GIL for their real work,
and a thread hands bins over without pickling their token tensors (measured: thread-based
tokenize+pack kept up with, and beat, a `multiprocessing` producer on the same workload).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, TypeVar

ItemT = TypeVar("ItemT")


class _EndOfStream:
    """Put once after the last item, and by `close`, so a consumer never blocks forever."""


@dataclass(frozen=True)
class _ProducerFailure:
    error: BaseException


_END = _EndOfStream()


class BackgroundBins(Generic[ItemT]):
    """Iterates `bins` in a producer thread; yields its items in production order.

    An exception raised by `bins` is re-raised in the consumer (the original object, traceback
    included). `close()`, also on context-manager exit, stops the producer: it finishes the item
    it is computing (with a packer, at most the rest of one window) and exits without waiting for
    room in the queue. `wait_s` is the time the consumer spent blocked on the queue: near zero
    when packing keeps up with the device.
    """

    def __init__(self, bins: Iterable[ItemT], max_ready_bins: int = 4) -> None:
        if max_ready_bins < 1:
            raise ValueError(f"max_ready_bins must be >= 1, got {max_ready_bins}")
        self._queue: queue.Queue[ItemT | _EndOfStream | _ProducerFailure] = queue.Queue(
            maxsize=max_ready_bins
        )
        self._stop = threading.Event()
        self.wait_s = 0.0  # consumer blocked on an empty queue: the device waiting for bins
        self.producer_blocked_s = 0.0  # producer blocked on a full queue: packing ran ahead
        self._thread = threading.Thread(
            target=self._produce, args=(bins,), name="vacpack-background-bins", daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Iterator[ItemT]:
        """Single pass: when the iteration ends for any reason (the last item, an error, the
        consumer breaking out and the generator being closed), the producer is stopped."""
        try:
            while True:
                started_s = time.perf_counter()
                item = self._queue.get()
                self.wait_s += time.perf_counter() - started_s
                if isinstance(item, _EndOfStream):
                    return
                if isinstance(item, _ProducerFailure):
                    raise item.error
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Stops the producer and waits for its thread to end. Safe to call more than once."""
        self._stop.set()
        # The stop flag is checked before every put, so after it is set the producer puts at
        # most once more; emptying the queue guarantees that put has room and cannot block.
        self._drain()
        self._thread.join()
        self._drain()
        self._queue.put(_END)  # iterating after close ends at once instead of blocking

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundBins[ItemT]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _produce(self, bins: Iterable[ItemT]) -> None:
        try:
            for item in bins:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as error:  # every failure must reach the consumer
            self._put(_ProducerFailure(error))

    def _put(self, item: ItemT | _EndOfStream | _ProducerFailure) -> bool:
        """False once the consumer has closed: the producer should stop."""
        if self._stop.is_set():
            return False
        started_s = time.perf_counter()
        self._queue.put(item)
        self.producer_blocked_s += time.perf_counter() - started_s
        return not self._stop.is_set()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
