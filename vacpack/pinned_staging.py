"""Host integers onto the device in one copy, without waiting on the work the device is doing.

On CUDA the values (a step's token ids, positions, sample rows; a corpus bin's token ids and
positions) are written into one of two alternating pinned host buffers and copied with
`non_blocking=True`. Each buffer has an event recorded after its copy: before the host refills a
buffer it waits on that event, which belongs to the copy before last, so the host never waits
on the step the device is running. With `copy_stream=True` the copy runs on a stream of its own
and the compute stream waits for it on the device, so the copy of bin N+1 overlaps the forward
of bin N. On a CPU the values are used where they are: there is nothing to copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

NUM_SLOTS = 2  # one buffer being copied while the other is filled

HostValues = Sequence[int] | torch.Tensor


class _PinnedSlot:
    def __init__(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.copy_done = torch.cuda.Event()
        self.in_flight = False

    def reserve(self, num_values: int) -> torch.Tensor:
        """The first `num_values` of the buffer, once no copy reads from it any more."""
        if self.in_flight:
            self.copy_done.synchronize()
            self.in_flight = False
        if num_values > self.host.numel():
            self.host = torch.empty(2 * num_values, dtype=torch.int64, pin_memory=True)
        return self.host[:num_values]


class PinnedStager:
    def __init__(
        self, device: torch.device, capacity: int = 1 << 16, copy_stream: bool = False
    ) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._slots: list[_PinnedSlot] = []
        self._copy_stream: torch.cuda.Stream | None = None
        self._next_slot = 0
        if device.type == "cuda":
            with torch.cuda.device(device):
                self._slots = [_PinnedSlot(capacity) for _ in range(NUM_SLOTS)]
                if copy_stream:
                    self._copy_stream = torch.cuda.Stream(device)

    def stage(self, arrays: Sequence[HostValues]) -> list[torch.Tensor]:
        """The arrays as int64 tensors on the device, ready for work queued next on the current
        stream (on CUDA the copy may still be in flight: the stream is ordered after it)."""
        if self.device.type == "cpu":
            return [torch.as_tensor(values, dtype=torch.int64) for values in arrays]
        if not self._slots:
            return [torch.as_tensor(values, dtype=torch.int64).to(self.device) for values in arrays]
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % NUM_SLOTS
        lengths = [len(values) for values in arrays]
        host = slot.reserve(sum(lengths))
        if all(isinstance(values, torch.Tensor) for values in arrays):
            for part, values in zip(host.split(lengths), arrays, strict=True):
                part.copy_(values)
        else:
            flat = itertools.chain.from_iterable(
                values.tolist() if isinstance(values, torch.Tensor) else values for values in arrays
            )
            host.copy_(torch.tensor(list(flat), dtype=torch.int64))
        on_device = self._copy(host, slot)
        slot.in_flight = True
        return list(on_device.split(lengths))

    def _copy(self, host: torch.Tensor, slot: _PinnedSlot) -> torch.Tensor:
        if self._copy_stream is None:
            on_device = host.to(self.device, non_blocking=True)
            slot.copy_done.record()
            return on_device
        compute_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            on_device = host.to(self.device, non_blocking=True)
            slot.copy_done.record(self._copy_stream)
        compute_stream.wait_event(slot.copy_done)
        # Allocated on the copy stream: keep the caching allocator from reusing this memory
        # until the compute stream's work queued so far has finished with it.
        on_device.record_stream(compute_stream)
        return on_device
