"""A `vacpack serve` process on a free loopback port, killed however the test ends.

Servers are forked from a zygote that has imported vacpack once (cli_zygote.DetachedZygote):
each is a real process of its own, without the 5-6 s of imports a fresh interpreter pays."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from cli_zygote import ChildProcess, DetachedZygote

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServerProcess:
    process: ChildProcess
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def metric_value(metrics_text: str, name: str) -> float:
    """The value of one unlabelled-or-single-series metric in Prometheus text."""
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in /metrics")


@contextmanager
def running_server(
    checkpoint: Path,
    *extra_args: str,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 90.0,
) -> Iterator[ServerProcess]:
    port = free_port()
    argv = [
        "serve",
        "--model", str(checkpoint),
        "--dtype", "float32",
        "--host", LOOPBACK,
        "--port", str(port),
        "--log-level", "warning",
        *extra_args,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vacpack-serve-") as log_dir:
        log_path = Path(log_dir) / "server.log"
        process = _zygote().start(argv, log_path, {**os.environ, **(env or {})})
        server = ServerProcess(process, f"http://{LOOPBACK}:{port}", log_path)
        try:
            _wait_until_healthy(server, startup_timeout_s)
            yield server
        finally:
            stop(server)


_ZYGOTES: list[DetachedZygote] = []


def _zygote() -> DetachedZygote:
    """The zygote servers are forked from, started on first use and ended with the tests."""
    if not _ZYGOTES:
        _ZYGOTES.append(DetachedZygote(Path(tempfile.mkdtemp(prefix="vacpack-zygote-"))))
        atexit.register(_ZYGOTES[0].close)
    return _ZYGOTES[0]


def stop(server: ServerProcess, timeout_s: float = 10.0) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


def _wait_until_healthy(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy after {timeout_s} s:\n{server.log()}")
