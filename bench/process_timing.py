"""Wall time that says how busy the machine was meanwhile, from the standard library alone.

Kept free of torch and vacpack, so that a worker running in another system's virtual
environment (bench/vllm_cpu_worker.py) times itself exactly as vacpack's workers do.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
def timed_section(own_cpu: Callable[[], float] = own_cpu_s) -> Iterator[TimedSection]:
    """Times the block. `own_cpu` is the CPU time of the system being measured: this process by
    default; a system that computes in child processes passes its whole process tree's."""
    section = TimedSection()
    busy_before_s, own_before_s = machine_busy_cpu_s(), own_cpu()
    start_s = time.perf_counter()
    yield section
    section.wall_s = time.perf_counter() - start_s
    own_used_s = own_cpu() - own_before_s
    section.other_processes_cpu_s = max(0.0, machine_busy_cpu_s() - busy_before_s - own_used_s)
