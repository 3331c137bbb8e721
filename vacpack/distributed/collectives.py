"""The collectives of one tensor-parallel group, on torch.distributed's own backends.

A group is a pair of c10d backend objects made from one rendezvous store: gloo on a CPU, NCCL on
CUDA. They are built directly, not through `init_process_group`, so no default process group
(global state) is created or needed: several tensor-parallel models, or a user's own
torch.distributed job, can live in one process, and closing a model leaves nothing behind.

On gloo every collective blocks the host until it is done, so the time spent in them is added
up (`blocked_s`): a step's communication time, waiting for the slower rank included. NCCL
collectives are queued on the device and return at once; their time is not measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


class C10dBackend(Protocol):
    """What we use of a c10d backend object (gloo's or NCCL's)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.GatherOptions,
    ) -> dist.Work: ...

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
    ) -> dist.Work: ...


def new_backend(
    store: dist.Store,
    name: str,
    rank: int,
    size: int,
    device_type: str,
    timeout: timedelta,
) -> C10dBackend:
    """A c10d backend over `store` (keys under `name`): gloo for "cpu", NCCL for "cuda"."""
    prefixed = dist.PrefixStore(name, store)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        options.global_ranks_in_group = list(range(size))
        options.group_name = name  # type: ignore[assignment]
        return cast(C10dBackend, dist.ProcessGroupNCCL(prefixed, rank, size, options))
    gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_options._timeout = timeout
    # Every rank runs on this machine: loopback needs no hostname lookup.
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return cast(C10dBackend, dist.ProcessGroupGloo(prefixed, rank, size, gloo_options))


class Collectives:
    """Sum, broadcast and gather over one backend; every rank calls them in the same order."""

    def __init__(self, backend: C10dBackend, rank: int, size: int) -> None:
        self.backend = backend
        self.rank = rank
        self.size = size
        self.blocks_host = not isinstance(backend, getattr(dist, "ProcessGroupNCCL", ()))
        self.blocked_s = 0.0  # host seconds inside gloo collectives, since creation

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` (contiguous) over the ranks, in place."""
        self._run(lambda: self.backend.allreduce([tensor]))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Every rank's `tensor` takes root's values."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._run(lambda: self.backend.broadcast([tensor], options))

    def gather(self, tensor: torch.Tensor, root: int = 0) -> list[torch.Tensor]:
        """Root gets every rank's `tensor` (same shape on each), in rank order; the other ranks
        get an empty list."""
        options = dist.GatherOptions()
        options.rootRank = root
        outputs = (
            [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == root else []
        )
        self._run(lambda: self.backend.gather(outputs, [tensor], options))
        return outputs[0] if outputs else []

    def all_gather_ints(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Each rank's `values` (the same count on each), in rank order, on every rank."""
        local = torch.tensor(values, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(local) for _ in range(self.size)]
        self._run(lambda: self.backend.allgather([gathered], [local]))
        return [part.tolist() for part in gathered]

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values, on every rank."""
        return min(row[0] for row in self.all_gather_ints([value], device))

    def _run(self, start: Callable[[], dist.Work]) -> None:
        if not self.blocks_host:
            start().wait()  # NCCL: the current stream waits for it, the host does not
            return
        start_s = time.perf_counter()
        start().wait()
        self.blocked_s += time.perf_counter() - start_s
