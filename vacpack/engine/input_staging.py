"""Moves a step's integer inputs to the device in one copy.

On CUDA the inputs (token ids, positions, sample rows, ...) are written into one of two
alternating pinned host buffers and copied with `non_blocking=True` on the current (compute)
stream. Each buffer has an event recorded after its copy: before the host refills a buffer it
waits on that event, which belongs to the step before last, so the host does not wait on the
step the device is running. Elsewhere the host tensors are used as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

NUM_SLOTS = 2  # one buffer being copied while the other is filled


class _PinnedSlot:
    def __init__(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.copy_done = torch.cuda.Event()
        self.in_flight = False

    def reserve(self, num_values: int) -> torch.Tensor:
        if self.in_flight:
            self.copy_done.synchronize()
            self.in_flight = False
        if num_values > self.host.numel():
            self.host = torch.empty(2 * num_values, dtype=torch.int64, pin_memory=True)
        return self.host[:num_values]


class InputStager:
    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._slots = (
            [_PinnedSlot(capacity) for _ in range(NUM_SLOTS)] if device.type == "cuda" else []
        )
        self._next_slot = 0

    def stage(self, arrays: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The arrays as int64 tensors on the device, for work queued next on this stream."""
        if not self._slots:
            return [torch.tensor(a, dtype=torch.int64).to(self.device) for a in arrays]
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % NUM_SLOTS
        lengths = [len(a) for a in arrays]
        host = slot.reserve(sum(lengths))
        host.copy_(torch.tensor(list(itertools.chain.from_iterable(arrays)), dtype=torch.int64))
        on_device = host.to(self.device, non_blocking=True)
        slot.copy_done.record()
        slot.in_flight = True
        return list(on_device.split(lengths))
