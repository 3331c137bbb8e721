"""Moves packed bins to the device so that the copy of bin N+1 overlaps the forward of bin N.

On CUDA a bin's token ids and positions are written into one of two alternating pinned host
buffers and copied with `non_blocking=True` on a dedicated copy stream. Each buffer has an event
recorded after its copy: before the host overwrites a buffer it waits on that event (the copy of
two bins back, never a forward), and the compute stream waits on it (on the device, without
blocking the host) before it runs anything that reads the bin. On the CPU the bin's own tensors
are returned as they are: there is nothing to copy.

Only token ids and positions are staged: the attention backend builds its own metadata (with
`cu_seqlens`) from `PackedBin.seq_lens` on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vacpack.corpus.packing import PackedBin

NUM_SLOTS = 2  # one buffer being copied while the other is filled


class StagedBin(NamedTuple):
    token_ids: torch.Tensor  # [num_tokens] int64 on the device
    positions: torch.Tensor  # [num_tokens] int64 on the device


class _PinnedSlot:
    """A pinned host buffer holding token ids then positions, so one copy moves both."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.host = torch.empty(2 * capacity_tokens, dtype=torch.int64, pin_memory=True)
        self.copy_done = torch.cuda.Event()
        self.copy_in_flight = False

    def wait_until_free(self) -> None:
        if self.copy_in_flight:
            self.copy_done.synchronize()
            self.copy_in_flight = False

    def ensure_capacity(self, num_tokens: int) -> None:
        # Only an oversize bin exceeds the budget; call after wait_until_free, so that the
        # buffer being replaced has no copy reading from it.
        if num_tokens > self.capacity_tokens:
            self.capacity_tokens = num_tokens
            self.host = torch.empty(2 * num_tokens, dtype=torch.int64, pin_memory=True)


class BinStager:
    def __init__(self, device: torch.device, budget_tokens: int) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._slots: list[_PinnedSlot] = []
        self._next_slot = 0
        if device.type == "cuda":
            with torch.cuda.device(device):
                self._copy_stream = torch.cuda.Stream(device)
                self._slots = [_PinnedSlot(budget_tokens) for _ in range(NUM_SLOTS)]

    def stage(self, packed_bin: PackedBin) -> StagedBin:
        """The bin's inputs on the device, ready for work queued afterwards on the current stream.

        On CUDA the copy may still be in flight when this returns; the current stream has been
        told to wait for it, so a forward queued on it next reads the right values.
        """
        if self.device.type == "cpu":
            return StagedBin(packed_bin.token_ids, packed_bin.positions)
        if self.device.type != "cuda":
            return StagedBin(
                packed_bin.token_ids.to(self.device), packed_bin.positions.to(self.device)
            )
        return self._stage_cuda(packed_bin)

    def _stage_cuda(self, packed_bin: PackedBin) -> StagedBin:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % NUM_SLOTS
        num_tokens = packed_bin.num_tokens
        slot.wait_until_free()
        slot.ensure_capacity(num_tokens)
        host = slot.host[: 2 * num_tokens]
        host[:num_tokens].copy_(packed_bin.token_ids)
        host[num_tokens:].copy_(packed_bin.positions)

        compute_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            # Allocated on the copy stream; record_stream below keeps the caching allocator from
            # reusing this memory until the compute stream's work queued so far has finished.
            on_device = host.to(self.device, non_blocking=True)
            slot.copy_done.record(self._copy_stream)
        slot.copy_in_flight = True
        compute_stream.wait_event(slot.copy_done)
        on_device.record_stream(compute_stream)
        return StagedBin(on_device[:num_tokens], on_device[num_tokens:])
