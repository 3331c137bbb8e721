"""Measurement helpers shared by the benchmarks: timing that says how busy the machine was,
peak memory, a heartbeat for long calls, the machine's description and its bf16 matmul peak."""

from __future__ import annotations

import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HEARTBEAT_INTERVAL_S = 30.0
MATMUL_WARMUP_REPS = 2
# Best of many: on a shared machine most repetitions are slowed by other work.
MATMUL_TIMED_REPS = 10


def log(message: str, prefix: str = "bench") -> None:
    """Progress goes to stderr, so stdout carries only the final table."""
    print(f"[{prefix}] {message}", file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextmanager
def heartbeat(name: str, status: Callable[[], str]) -> Iterator[None]:
    """Prints a status line every HEARTBEAT_INTERVAL_S, so a long timed call shows it is alive."""
    stop = threading.Event()
    start_s = time.perf_counter()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            log(f"{name}: {time.perf_counter() - start_s:.0f} s in; {status()}", name)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def machine_busy_cpu_s() -> float:
    """CPU seconds all processes on the machine have spent busy since boot, from /proc/stat."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle_ticks = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks) - idle_ticks) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return usage.ru_utime + usage.ru_stime


@dataclass
class TimedSection:
    wall_s: float = 0.0
    # CPU time other processes used while the section ran. torch runs one thread per core, so
    # any other busy process can slow its thread barriers many times over; this says when.
    other_processes_cpu_s: float = 0.0

    def fields(self) -> dict[str, float]:
        core_seconds = self.wall_s * (os.cpu_count() or 1)
        return {
            "wall_s": self.wall_s,
            "other_processes_cpu_s": self.other_processes_cpu_s,
            # 0 on a quiet machine; 1 if other processes kept every core busy throughout.
            "other_processes_core_share": self.other_processes_cpu_s / core_seconds,
        }


@contextmanager
def timed_section() -> Iterator[TimedSection]:
    section = TimedSection()
    busy_before_s, own_before_s = machine_busy_cpu_s(), own_cpu_s()
    start_s = time.perf_counter()
    yield section
    section.wall_s = time.perf_counter() - start_s
    own_used_s = own_cpu_s() - own_before_s
    section.other_processes_cpu_s = max(0.0, machine_busy_cpu_s() - busy_before_s - own_used_s)


def best_linear_tflops(
    num_rows: int, in_features: int, out_features: int, generator: torch.Generator
) -> dict[str, Any]:
    """Best bfloat16 F.linear TFLOPS over MATMUL_TIMED_REPS runs at one shape."""
    x = torch.randn(num_rows, in_features, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    for _ in range(MATMUL_WARMUP_REPS):
        torch.nn.functional.linear(x, weight)
    times_s = []
    for _ in range(MATMUL_TIMED_REPS):
        start_s = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        times_s.append(time.perf_counter() - start_s)
    flops = 2 * num_rows * in_features * out_features
    return {
        "shape": f"[{num_rows}, {in_features}] x [{in_features}, {out_features}]",
        "best_s": min(times_s),
        "best_tflops": flops / min(times_s) / 1e12,
    }


def machine_description() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model_names = [
        ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")
    ]
    flag_lines = [ln for ln in cpuinfo.splitlines() if ln.startswith("flags")]
    flags = set(flag_lines[0].split(":", 1)[1].split()) if flag_lines else set()
    import transformers

    return {
        "cpu_model": model_names[0] if model_names else platform.processor() or "unknown",
        "num_cores": os.cpu_count(),
        "num_usable_cores": len(os.sched_getaffinity(0)),
        # Which bfloat16 matmul paths oneDNN can use on this CPU.
        "bf16_cpu_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f"}),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
    }
