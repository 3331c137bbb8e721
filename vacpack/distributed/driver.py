"""Rank 0's side of a running tensor-parallel group: device programs run in lockstep.

Every piece of device work that involves collectives (an engine step, a corpus bin, an LM-head
pass for a corpus task, the engine's setup) is a program: rank 0 sends one control message
naming it and its inputs, then runs it; every other rank receives the message and runs the
same program on its shard. Programs never overlap (one lock), so every rank issues the same
collectives in the same order, whichever of rank 0's threads runs them.

A program that fails leaves the ranks out of step, so the group is finished: the error names
the worker that died or raised (with its traceback in the log), the workers are stopped, and
every later program raises the same error at once.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from vacpack.distributed.control import Program
from vacpack.distributed.group import GroupMember
from vacpack.distributed.workers import WorkerProcesses
from vacpack.errors import VacpackError

logger = logging.getLogger(__name__)

# How long a failed program waits for a worker's death or error report to explain it.
FAILURE_REPORT_S = 5.0
SHUTDOWN_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed; the model must be loaded again."""


class Driver:
    def __init__(self, member: GroupMember, workers: WorkerProcesses, store: dist.Store) -> None:
        assert member.rank == 0, "rank 0 drives the group"
        self.member = member
        self.workers = workers
        self._store = store  # the rendezvous store lives as long as the group
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._closed = False
        workers.watch(weakref.WeakMethod(self._on_worker_failure))

    @property
    def size(self) -> int:
        return self.member.size

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    @contextmanager
    def program(self, kind: Program, payload: Sequence[int] | torch.Tensor = ()) -> Iterator[None]:
        """Sends the program's message, then runs the body (rank 0's part of it)."""
        with self._lock:
            self.raise_if_failed()
            try:
                self.member.control.send(kind, payload)
                yield
            except Exception as error:
                raise self._fail(kind, error) from error
            except BaseException as interruption:  # Ctrl-C: the ranks are out of step too
                self._failure = (
                    f"rank 0 was interrupted in {kind.name} ({type(interruption).__name__}); "
                    "the ranks are out of step and the model must be loaded again"
                )
                self.workers.stop(timeout_s=1.0)
                raise

    @contextmanager
    def startup(self) -> Iterator[None]:
        """Around rank 0's part of starting the group (loading its shard): an error stops the
        workers, and one a worker caused is named."""
        try:
            yield
        except VacpackError:
            # Bad input (a missing or damaged checkpoint): every rank reads it alike, and rank
            # 0's own error, with its exit code, says what is wrong.
            self._closed = True
            self.workers.stop(timeout_s=1.0)
            raise
        except Exception as error:
            failure = self.workers.wait_for_failure(FAILURE_REPORT_S)
            self._closed = True
            self.workers.stop(timeout_s=1.0)
            if failure is None:
                raise
            logger.error("%s\n%s", failure, self.workers.error_traceback())
            raise TensorParallelError(failure) from error

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        if self._closed:
            raise TensorParallelError("the tensor-parallel group was closed")

    def close(self) -> None:
        """Asks the workers to leave, then makes sure they have (terminate, then kill)."""
        if self._closed:
            return
        self._closed = True
        # A program still running on another thread (an interrupted step) holds the lock; the
        # workers are then stopped without the message.
        if self._failure is None and self._lock.acquire(timeout=1.0):
            try:
                self.member.control.send(Program.SHUTDOWN)
            except Exception:  # a worker already gone: stopping it is all that is left
                logger.debug("shutdown message not delivered", exc_info=True)
            finally:
                self._lock.release()
        self.workers.stop(SHUTDOWN_TIMEOUT_S)

    def _fail(self, kind: Program, error: Exception) -> TensorParallelError:
        if self._failure is None:
            worker_failure = self.workers.wait_for_failure(FAILURE_REPORT_S)
            if worker_failure is not None:
                logger.error("%s\n%s", worker_failure, self.workers.error_traceback())
                self._failure = f"{worker_failure}; the model must be loaded again"
            else:
                self._failure = (
                    f"rank 0 failed in {kind.name} ({type(error).__name__}: {error}); the "
                    "ranks are out of step and the model must be loaded again"
                )
            self.workers.stop(timeout_s=1.0)
        return TensorParallelError(self._failure)

    def _on_worker_failure(self, description: str) -> None:
        """A worker stopped by itself. On CUDA, NCCL would wait for it until its timeout: the
        device backend is aborted so that rank 0's pending collectives fail now."""
        if self._failure is None and not self._closed:
            logger.error("%s\n%s", description, self.workers.error_traceback())
            self._failure = f"{description}; the model must be loaded again"
        abort = getattr(self.member.collectives.backend, "abort", None)
        if abort is not None and not self.member.collectives.blocks_host:
            abort()
