"""Forming a tensor-parallel group: rank 0 opens a rendezvous store and spawns the other ranks;
every rank then joins the group's two backends.

- the control backend (gloo, on the host) carries rank 0's messages (control.py); a rank waits
  on it for as long as the model is loaded (an idle server sends nothing for hours);
- the device backend (gloo on a CPU, NCCL on CUDA) carries the model's collectives; a
  collective that waits longer than COLLECTIVE_TIMEOUT fails rather than hanging.
A rank that dies closes its connections, and every other rank's pending collective fails at
once, so neither timeout is how a dead rank is noticed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vacpack.distributed.collectives import LOOPBACK, Collectives, new_backend
from vacpack.distributed.control import ControlChannel
from vacpack.distributed.workers import WorkerProcesses, WorkerTarget

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
CONTROL_TIMEOUT = timedelta(days=365)
# Spawning a worker imports torch and vacpack afresh: seconds, or a minute on a busy machine.
STARTUP_TIMEOUT_S = 300.0
STARTUP_POLL_S = 0.05


@dataclass(frozen=True)
class GroupMember:
    """One rank's handles on its group."""

    rank: int
    size: int
    collectives: Collectives
    control: ControlChannel


@dataclass(frozen=True)
class WorkerArgs:
    """What a spawned rank needs to join: the store's port, and the caller's own arguments."""

    store_port: int
    size: int
    device_type: str
    payload: Any


def start_group(
    size: int, device_type: str, worker_target: WorkerTarget, payload: Any
) -> tuple[GroupMember, WorkerProcesses, dist.Store]:
    """Rank 0: spawns ranks 1..size-1 running `worker_target(rank, WorkerArgs)` (which calls
    `join_group` first), and joins the group with them. Raises RuntimeError, naming the rank
    and its error, if one fails to start."""
    store = dist.TCPStore(
        LOOPBACK,
        0,
        size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
    )
    workers = WorkerProcesses(
        worker_target, WorkerArgs(store.port, size, device_type, payload), size
    )
    try:
        _wait_for_workers(store, workers, size)
        member = join_group(store, 0, size, device_type)
    except BaseException:
        workers.stop(timeout_s=1.0)
        raise
    return member, workers, store


def join_group(store: dist.Store, rank: int, size: int, device_type: str) -> GroupMember:
    """Every rank: the group's control and device backends (blocks until all ranks join)."""
    store.set(f"started/{rank}", "1")
    control = new_backend(store, "control", rank, size, "cpu", CONTROL_TIMEOUT)
    device = new_backend(store, "device", rank, size, device_type, COLLECTIVE_TIMEOUT)
    return GroupMember(rank, size, Collectives(device, rank, size), ControlChannel(control, rank))


def connect_to_store(args: WorkerArgs) -> dist.Store:
    """A spawned rank's client of rank 0's store."""
    return dist.TCPStore(
        LOOPBACK,
        args.store_port,
        args.size,
        is_master=False,
        timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
    )


def _wait_for_workers(store: dist.Store, workers: WorkerProcesses, size: int) -> None:
    """Until every worker has reached the store; a worker that dies on the way (an import
    error, a bad device) fails this at once rather than after the store's timeout."""
    keys = [f"started/{rank}" for rank in range(1, size)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        failure = workers.failure()
        if failure is not None:
            raise RuntimeError(f"{failure}\n{workers.error_traceback()}")
        if store.check(keys):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s"
            )
        workers.wait_for_failure(timeout_s=STARTUP_POLL_S)


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank r runs on GPU r of this machine, or on the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
