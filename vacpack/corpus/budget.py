"""The bin budget: how many tokens one packed forward may hold, measured on the device.

Probe forwards at doubling sizes are timed (and, on CUDA, run until memory runs out). The
budget is the largest probed size that still fits in memory with a margin, stopping early once
doubling the bin no longer raises throughput: past that point bigger bins only cost memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vacpack.device import available_host_memory_bytes, host_peak_memory_bytes

logger = logging.getLogger(__name__)

FIRST_PROBE_TOKENS = 256
# Doubling the bin must raise tokens/s by at least this much to be worth its memory.
MIN_THROUGHPUT_GAIN = 0.05
# Share of the memory left after loading that bins may use (the rest: logits slices, the
# packer's queue, the allocator's fragmentation).
MEMORY_MARGIN = 0.5


@dataclass(frozen=True)
class BinBudget:
    tokens: int
    source: str


def measure_bin_budget(
    forward: Callable[[int], None], device: torch.device, max_tokens: int
) -> BinBudget:
    """`forward(n)` runs one packed forward of n tokens; `max_tokens` bounds the search."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        memory_bytes = int(free_bytes * MEMORY_MARGIN)
    else:
        memory_bytes = int(available_host_memory_bytes() * MEMORY_MARGIN)
    baseline_bytes = 0 if device.type == "cuda" else host_peak_memory_bytes()
    best_tokens, best_rate = 0, 0.0
    num_tokens = min(FIRST_PROBE_TOKENS, max_tokens)
    bytes_per_token = 0.0
    while True:
        try:
            rate, used_bytes = _probe(forward, device, num_tokens, baseline_bytes)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        bytes_per_token = max(bytes_per_token, used_bytes / num_tokens)
        gained = rate > best_rate * (1 + MIN_THROUGHPUT_GAIN)
        if gained or best_tokens == 0:
            best_tokens, best_rate = num_tokens, max(rate, best_rate)
        next_tokens = min(num_tokens * 2, max_tokens)
        fits = bytes_per_token * next_tokens <= memory_bytes
        if not gained or not fits or next_tokens == num_tokens:
            break
        num_tokens = next_tokens
    logger.info("bin budget %d tokens: %.0f tokens/s in the probe", best_tokens, best_rate)
    return BinBudget(
        best_tokens,
        f"measured: {best_rate:,.0f} tokens/s in a probe, ~{bytes_per_token / 1024:.0f} KiB/token",
    )


def _probe(
    forward: Callable[[int], None], device: torch.device, num_tokens: int, baseline_bytes: int
) -> tuple[float, float]:
    """(tokens/s of a warm forward, bytes of peak memory a forward of this size needs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline_bytes = torch.cuda.memory_allocated(device)
    forward(num_tokens)  # also the warm-up: first-call allocations and kernel selection
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        used_bytes = torch.cuda.max_memory_allocated(device) - baseline_bytes
    else:
        # ru_maxrss only grows: the process's peak above what it was before any probe.
        used_bytes = max(host_peak_memory_bytes() - baseline_bytes, 0)
    # The best of two timed runs: one run on a shared machine is easily slowed by others.
    best_s = float("inf")
    for _ in range(2):
        start_s = time.perf_counter()
        forward(num_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - start_s)
    return num_tokens / best_s, float(used_bytes)
