"""Rank 0's messages to the other ranks: what device work to run next, as one int32 broadcast.

A message is a kind (a `Program`) and a payload of integers, sent on a gloo group of its own
on the host, whatever the device: rank 0 sends a step's inputs the moment it launches the step,
and the other ranks prepare theirs while their devices may still be busy with the step before.

Every rank must know a broadcast's size before it arrives, so messages travel in a buffer of a
capacity every rank agrees on. A message that does not fit is announced by a `GROW` message
carrying the new capacity (the next power of two); both sides grow and the message follows.
Capacity only grows, so a run settles at one broadcast per message.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist

from vacpack.distributed.collectives import C10dBackend

HEADER_INTS = 2  # kind, payload length
INITIAL_CAPACITY_INTS = 4096


class Program(enum.IntEnum):
    """What a message asks the other ranks to run; each owner documents its payload."""

    GROW = 0  # payload: the new capacity (internal to the channel)
    ENGINE_SETUP = 1  # engine/device_setup.py
    ENGINE_STEP = 2  # engine/step_inputs.py
    PACKED_FORWARD = 3  # corpus/forward.py
    LONG_DOCUMENT = 4  # corpus/forward.py
    LM_HEAD = 5  # runtime.py
    SHUTDOWN = 6  # no payload: leave the worker loop
    LORA_ADAPTER = 7  # lora/manager.py: an adapter loaded or removed


class ControlChannel:
    def __init__(self, backend: C10dBackend, rank: int) -> None:
        self.backend = backend
        self.rank = rank
        self.capacity_ints = INITIAL_CAPACITY_INTS
        self._buffer = torch.zeros(self.capacity_ints, dtype=torch.int32)

    def send(self, kind: Program, payload: Sequence[int] | torch.Tensor = ()) -> None:
        """Rank 0: broadcasts one message (values must fit in int32)."""
        assert self.rank == 0, "only rank 0 sends"
        values = torch.as_tensor(payload, dtype=torch.int32).flatten()
        needed = HEADER_INTS + values.numel()
        if needed > self.capacity_ints:
            new_capacity = 1 << (needed - 1).bit_length()
            self._write_and_broadcast(Program.GROW, torch.tensor([new_capacity]))
            self._resize(new_capacity)
        self._write_and_broadcast(kind, values)

    def receive(self) -> tuple[Program, torch.Tensor]:
        """The other ranks: blocks until rank 0's next message; returns its kind and payload
        (a view into the channel's buffer, valid until the next receive)."""
        while True:
            self._broadcast()
            kind = Program(int(self._buffer[0]))
            payload = self._buffer[HEADER_INTS : HEADER_INTS + int(self._buffer[1])]
            if kind != Program.GROW:
                return kind, payload
            self._resize(int(payload[0]))

    def _write_and_broadcast(self, kind: Program, values: torch.Tensor) -> None:
        self._buffer[0] = int(kind)
        self._buffer[1] = values.numel()
        self._buffer[HEADER_INTS : HEADER_INTS + values.numel()] = values
        self._broadcast()

    def _broadcast(self) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.backend.broadcast([self._buffer], options).wait()

    def _resize(self, capacity_ints: int) -> None:
        self.capacity_ints = capacity_ints
        self._buffer = torch.zeros(capacity_ints, dtype=torch.int32)
