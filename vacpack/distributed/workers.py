"""The other ranks' processes: spawned, watched, and stopped so that none outlives rank 0.

Ranks 1..N-1 start with torch.multiprocessing's spawn (a fresh interpreter each: CUDA cannot run
in a forked child) as daemon processes, which multiprocessing also ends when rank 0's
interpreter exits. Each worker has a pipe back to rank 0 that carries at most one message: the
traceback of the error that stopped it. A worker ignores Ctrl-C (a terminal sends it to the
whole process group; rank 0 decides what stops), and leaves by itself within a second of rank 0
dying, whatever it was doing: a worker never outlives its rank 0, even one killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
WorkerTarget = Callable[[int, Any], None]  # (rank, the worker's arguments)


def _worker_entry(
    target: WorkerTarget,
    rank: int,
    worker_args: Any,
    error_pipe: multiprocessing.connection.Connection,
    parent_pid: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid,), name="vacpack-parent-watch", daemon=True
    ).start()
    try:
        target(rank, worker_args)
    except BaseException:  # whatever stops the worker is rank 0's to report
        with contextlib.suppress(OSError):  # unless rank 0 is gone, and with it the reason
            error_pipe.send(traceback.format_exc())
            error_pipe.close()
        sys.exit(1)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


class WorkerProcesses:
    """Ranks 1..size-1, each running `target(rank, worker_args)`."""

    def __init__(self, target: WorkerTarget, worker_args: Any, size: int) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self.processes: list[Any] = []
        self._error_pipes: list[multiprocessing.connection.Connection] = []
        self._errors: dict[int, str] = {}
        self._stopping = False  # set by stop(): a worker leaving then is no failure
        for rank in range(1, size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_entry,
                args=(target, rank, worker_args, writer, os.getpid()),
                name=f"vacpack-rank-{rank}",
                daemon=True,
            )
            process.start()
            writer.close()  # the child holds the writing end now
            self.processes.append(process)
            self._error_pipes.append(reader)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def failure(self) -> str | None:
        """What stopped a worker, if one has stopped (its error, or how it ended); else None."""
        for rank, (process, pipe) in enumerate(
            zip(self.processes, self._error_pipes, strict=True), start=1
        ):
            if rank not in self._errors and not pipe.closed and pipe.poll():
                with contextlib.suppress(EOFError, OSError):  # it died mid-report
                    self._errors[rank] = pipe.recv()
            if rank in self._errors:
                last_line = self._errors[rank].strip().splitlines()[-1]
                return f"tensor-parallel rank {rank} (pid {process.pid}) failed: {last_line}"
            if process.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {process.pid}) {_ended(process.exitcode)}"
        return None

    def error_traceback(self) -> str:
        """The tracebacks workers sent, for the log."""
        return "\n".join(f"rank {rank}:\n{text}" for rank, text in sorted(self._errors.items()))

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """A worker's failure, waiting up to timeout_s for one to show."""
        deadline = time.monotonic() + timeout_s
        while True:
            failure = self.failure()
            remaining_s = deadline - time.monotonic()
            if failure is not None or remaining_s <= 0:
                return failure
            waitables: list[Any] = [p.sentinel for p in self.processes]
            waitables += [pipe for pipe in self._error_pipes if not pipe.closed]
            multiprocessing.connection.wait(waitables, timeout=min(remaining_s, 0.5))

    def watch(self, on_failure: weakref.WeakMethod[Callable[[str], None]]) -> None:
        """Calls on_failure(description) from a background thread if a worker stops first.

        The thread holds the callback's owner weakly: an object that owns process groups must
        be freed by the thread that drops it last, and at interpreter exit a daemon thread
        cannot free one (pybind11 gives up the GIL inside the destructor and cannot take it
        back: the process aborts)."""
        sentinels = [p.sentinel for p in self.processes]

        def watch_processes() -> None:
            multiprocessing.connection.wait(sentinels)
            if self._stopping:
                return
            failure = self.wait_for_failure(timeout_s=1.0)
            callback = on_failure()
            if failure is not None and not self._stopping and callback is not None:
                callback(failure)

        threading.Thread(target=watch_processes, name="vacpack-rank-watch", daemon=True).start()

    def stop(self, timeout_s: float) -> None:
        """Waits up to timeout_s for the workers to leave, then terminates, then kills them."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                logger.warning("tensor-parallel worker pid %d ignored SIGTERM: killed", process.pid)
                process.kill()
                process.join()
        self.failure()  # reads any error report before the pipes close
        for pipe in self._error_pipes:
            pipe.close()


def _ended(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"
