"""Real `vacpack` processes without paying the interpreter's start-up each time.

A zygote process imports vacpack (torch, transformers) once, then forks a fresh child for each
command line it is sent. Every child is a real process: its own exit status, its own files, a
SIGKILL that kills it mid-write. Only the 3-6 s of imports are shared, which is what lets the
fault tests kill and restart a run a dozen times in a few seconds. The zygote runs no torch
work before it forks (OpenMP's thread pool must not exist in a process that forks).

Protocol, JSON lines: the test sends {"argv", "cwd", "env", "stdout", "stderr",
"fsize_limit_bytes"}; the zygote answers {"pid"} at once, then {"pid", "status"} when the
child exits (status as subprocess reports it: the exit code, or -N for signal N).

A detached zygote (`DetachedZygote`, for servers) takes the next request while its children
run: each answer names its child, and `ChildProcess` gives a child subprocess.Popen's methods.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

_HERE = Path(__file__).resolve().parent
_REPO_ROOT = _HERE.parent
COMMAND_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Finished:
    status: int
    stdout: str
    stderr: str


def _start_zygote(entry: str, cwd: Path) -> subprocess.Popen[str]:
    """A zygote process running this module's function `entry`, spoken to over its pipes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_REPO_ROOT), str(_HERE)])}
    return subprocess.Popen(
        [sys.executable, "-c", f"import cli_zygote; cli_zygote.{entry}()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=cwd,
        text=True,
    )


class Zygote:
    """The test's side: start, kill and wait for `vacpack` child processes, one at a time."""

    def __init__(self, work_dir: Path) -> None:
        self._work_dir = work_dir
        self._num_started = 0
        self._process = _start_zygote("serve", _REPO_ROOT)
        # Replies are read on a thread so that waiting for one can time out.
        self._replies: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_replies, daemon=True).start()
        assert self._receive(timeout_s=COMMAND_TIMEOUT_S)["ready"]

    def start(
        self,
        argv: list[str],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        fsize_limit_bytes: int | None = None,
    ) -> int:
        """Starts `vacpack ARGV` in a child; returns its pid."""
        self._num_started += 1
        self._output_stem = self._work_dir / f"child-{self._num_started}"
        request = {
            "argv": argv,
            "cwd": str(cwd or self._work_dir),
            "env": env or {},
            "stdout": f"{self._output_stem}.out",
            "stderr": f"{self._output_stem}.err",
            "fsize_limit_bytes": fsize_limit_bytes,
        }
        self._send(request)
        self._pid = self._receive(timeout_s=COMMAND_TIMEOUT_S)["pid"]
        return self._pid

    def wait(self, timeout_s: float = COMMAND_TIMEOUT_S) -> Finished:
        """Waits for the child started last; its status and what it printed. A child still
        running after `timeout_s` is killed and the test fails: no test hangs on one."""
        try:
            status = self._receive(timeout_s)["status"]
        except TimeoutError:
            os.kill(self._pid, signal.SIGKILL)
            self._receive(timeout_s=COMMAND_TIMEOUT_S)
            raise AssertionError(
                f"a vacpack command ran over {timeout_s} s and was killed"
            ) from None
        return Finished(
            status,
            Path(f"{self._output_stem}.out").read_text(errors="replace"),
            Path(f"{self._output_stem}.err").read_text(errors="replace"),
        )

    def run(self, argv: list[str], **kwargs: Any) -> Finished:
        self.start(argv, **kwargs)
        return self.wait()

    def close(self) -> None:
        # Between commands the zygote holds nothing worth a clean exit (and torch's takes seconds).
        self._process.kill()
        self._process.wait()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def _read_replies(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._replies.put(line)
        self._replies.put("")  # the zygote exited

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError from None
        if not line:
            raise RuntimeError(f"the zygote exited with status {self._process.wait()}")
        return json.loads(line)


class DetachedZygote:
    """The test's side of a zygote whose children run side by side (servers): start one, go on,
    and learn its exit status whenever it comes."""

    def __init__(self, work_dir: Path) -> None:
        self._process = _start_zygote("serve_detached", work_dir)
        self._lock = threading.Lock()
        self._started: queue.Queue[int] = queue.Queue()
        self._statuses: dict[int, int] = {}
        threading.Thread(target=self._read_replies, daemon=True).start()
        assert self._started.get(timeout=COMMAND_TIMEOUT_S) == 0, "the zygote did not start"

    def start(self, argv: list[str], log_path: Path, env: dict[str, str]) -> ChildProcess:
        """`vacpack ARGV` in a child with `env` (the whole environment it runs in), its
        stdout and stderr both into `log_path`."""
        request = {
            "argv": argv,
            "cwd": str(log_path.parent),
            "env": env,
            "stdout": str(log_path),
            "stderr": str(log_path),
            "fsize_limit_bytes": None,
        }
        assert self._process.stdin is not None
        with self._lock:  # one request at a time, so the next pid answered is this one's
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            pid = self._started.get(timeout=COMMAND_TIMEOUT_S)
        return ChildProcess(self, pid)

    def status(self, pid: int) -> int | None:
        return self._statuses.get(pid)

    def close(self) -> None:
        self._process.kill()
        self._process.wait()

    def _read_replies(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            reply = json.loads(line)
            if "status" in reply:
                self._statuses[reply["pid"]] = reply["status"]
            else:
                self._started.put(reply.get("pid", 0))


class ChildProcess:
    """A detached zygote's child, with the subprocess.Popen methods the tests use."""

    def __init__(self, zygote: DetachedZygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._zygote.status(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.returncode) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return status

    def send_signal(self, signal_number: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _import_for_children() -> Callable[[list[str]], int]:
    """What every child would import itself, imported once before the forks; returns the
    command line's entry point, which the children run."""
    # torch imports these (sympy among them, about 1.5 s) on a model's first to_empty().
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    import vacpack.batch.prompt_file
    import vacpack.batch.runner
    import vacpack.cli
    import vacpack.corpus.runner
    import vacpack.corpus.tasks  # imported here to be shared with every child

    return vacpack.cli.main


def serve_detached() -> None:
    """The detached zygote's side: a child forked per request, answered with its pid at once,
    each child's exit status sent when it is reaped; one thread, so that forking is safe."""
    main = _import_for_children()
    import vacpack.server.app  # noqa: F401  (the servers' own imports)

    channel = sys.stdout
    _reply(channel, {"ready": True})
    stdin_fd, pending, running = sys.stdin.fileno(), b"", set()
    while True:
        readable, _, _ = select.select([stdin_fd], [], [], 0.05)
        if readable:
            data = os.read(stdin_fd, 1 << 16)
            if not data:
                return  # the tests are done
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                channel.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(json.loads(line), main)
                running.add(pid)
                _reply(channel, {"pid": pid})
        for pid in list(running):
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                _reply(channel, {"pid": pid, "status": os.waitstatus_to_exitcode(wait_status)})


def serve() -> None:
    """The zygote's side: import once, then fork one child per request until stdin closes."""
    main = _import_for_children()

    channel = sys.stdout
    _reply(channel, {"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        channel.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request, main)
        _reply(channel, {"pid": pid})
        _, wait_status = os.waitpid(pid, 0)
        _reply(channel, {"pid": pid, "status": os.waitstatus_to_exitcode(wait_status)})


def _reply(channel: IO[str], message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def _run_child(request: dict[str, Any], main: Any) -> None:
    code = 70  # EX_SOFTWARE: the child itself failed before running the command
    try:
        os.chdir(request["cwd"])
        os.environ.update(request["env"])
        if request["fsize_limit_bytes"] is not None:
            import resource

            limit = request["fsize_limit_bytes"]
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        _redirect(0, os.devnull, os.O_RDONLY)
        _redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        if request["stderr"] == request["stdout"]:
            os.dup2(1, 2)  # one file, one offset: interleaved as written
        else:
            _redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            code = main(request["argv"])
        except SystemExit as exit_request:  # argparse's usage errors
            code = exit_request.code if isinstance(exit_request.code, int) else 2
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _redirect(fd: int, path: str, flags: int) -> None:
    new_fd = os.open(path, flags, 0o644)
    os.dup2(new_fd, fd)
    os.close(new_fd)
