"""Where a step's device work runs, and how the host learns that it is done.

The engine hands every step's device work (input copy, forward, sampling, result copy) to an
executor and gets a handle back; `handle.wait()` returns the host-side results and when the
device started and finished, on the host's `time.perf_counter()` clock.

- `InlineExecutor` (CPU, synchronous): the host runs the work itself; `wait` returns at once.
- `ThreadExecutor` (CPU, async scheduling): one worker thread runs the steps in launch order,
  so the host can read step N's results and prepare step N+1 while the worker computes.
  torch releases the GIL inside its kernels, so both make progress.
- `CudaStreamExecutor`: the work is queued on a dedicated compute stream and returns at once
  (it only launches kernels and non-blocking copies to pinned memory); events mark its start,
  its end, and the moment its results are on the host, so `wait` is one event wait, never a
  device-wide synchronize().

Steps run on the device in the order they are launched, whatever the executor. The engine
relies on that: a page freed while a launched step may still write it can only be reused by a
later step, which runs after that write.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceTiming:
    device_start_s: float  # host perf_counter clock
    device_end_s: float


class StepHandle(ABC, Generic[T]):
    @abstractmethod
    def wait(self) -> tuple[T, DeviceTiming]:
        """Blocks until the step's results are on the host; returns them and its timing."""


class StepExecutor(ABC):
    # True when `launch` returns before the work is done, so that overlapping helps.
    runs_concurrently: bool = False
    # True when the work runs on a thread of its own, so it may wait for something the host
    # provides after `launch` returned (a step's token masks; see vacpack/structured).
    work_may_wait_for_host: bool = False

    @abstractmethod
    def launch(self, work: Callable[[], T]) -> StepHandle[T]:
        """Starts `work` on the device; steps run in the order they are launched."""

    def stream_context(self) -> AbstractContextManager[object]:
        """Where the host prepares and launches a step: on CUDA, the compute stream, so that
        input copies are ordered before the step's kernels."""
        return nullcontext()

    def close(self) -> None:  # noqa: B027  (most executors hold nothing to release)
        """Releases the executor's resources (threads)."""


class _DoneHandle(StepHandle[T]):
    def __init__(self, value: T, timing: DeviceTiming) -> None:
        self._value = value
        self._timing = timing

    def wait(self) -> tuple[T, DeviceTiming]:
        return self._value, self._timing


def _timed(work: Callable[[], T]) -> tuple[T, DeviceTiming]:
    start_s = time.perf_counter()
    value = work()
    return value, DeviceTiming(start_s, time.perf_counter())


class InlineExecutor(StepExecutor):
    def launch(self, work: Callable[[], T]) -> StepHandle[T]:
        return _DoneHandle(*_timed(work))


class _FutureHandle(StepHandle[T]):
    def __init__(self, future: Future[tuple[T, DeviceTiming]]) -> None:
        self._future = future

    def wait(self) -> tuple[T, DeviceTiming]:
        return self._future.result()


class ThreadExecutor(StepExecutor):
    runs_concurrently = True
    work_may_wait_for_host = True

    def __init__(self) -> None:
        # One worker: steps must run in launch order (see the module docstring).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vacpack-device")
        num_threads = torch.get_num_threads()
        # Intra-op thread counts are per thread in torch: the worker gets the host's setting.
        self._pool.submit(torch.set_num_threads, num_threads).result()

    def launch(self, work: Callable[[], T]) -> StepHandle[T]:
        return _FutureHandle(self._pool.submit(_timed, work))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _CudaHandle(StepHandle[T]):
    def __init__(
        self,
        value: T,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
        clock: CudaClock,
    ) -> None:
        self._value = value
        self._start = start
        self._end = end
        self._clock = clock

    def wait(self) -> tuple[T, DeviceTiming]:
        # `end` is recorded after the result copies to pinned memory were queued.
        self._end.synchronize()
        return self._value, DeviceTiming(
            self._clock.host_time_s(self._start), self._clock.host_time_s(self._end)
        )


class CudaClock:
    """Turns CUDA events into host perf_counter times through one anchor event."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record()
        self._anchor.synchronize()
        self._anchor_host_s = time.perf_counter()

    def host_time_s(self, event: torch.cuda.Event) -> float:
        return self._anchor_host_s + self._anchor.elapsed_time(event) / 1e3


class CudaStreamExecutor(StepExecutor):
    runs_concurrently = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._clock = CudaClock(device)

    def launch(self, work: Callable[[], T]) -> StepHandle[T]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            value = work()
            end.record(self.stream)
        return _CudaHandle(value, start, end, self._clock)

    def stream_context(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self.stream)


def create_executor(device: torch.device, async_scheduling: bool) -> StepExecutor:
    if device.type == "cuda":
        return CudaStreamExecutor(device)
    return ThreadExecutor() if async_scheduling else InlineExecutor()
