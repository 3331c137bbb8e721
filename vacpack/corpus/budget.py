"""The bin budget: how many tokens one packed forward may hold, measured on the device.

Probe forwards at doubling sizes are timed (and, on CUDA, run until memory runs out). The
budget is the largest probed size that fits in memory with a margin and is not slower than
the best, and the search stops once doubling the bin no longer raises throughput, unless a
forward is still short: every bin also pays fixed host costs that a probe of long sequences
hardly shows (attention metadata, a few hundred kernel calls from Python, pooling or the LM
head's passes), and a corpus of short documents pays them per bin of several documents. On
E1's texts (2-core CPU), where a 256-token forward takes under 20 ms, 2,048-token bins ran
up to 10% faster than the 256 tokens the probe alone had found as fast.

A size whose forward is that short is never the budget while a larger one fits: on E1 a noisy
256-token probe once outran the 512-token one and stopped the search there, and the job then
ran about 1.2x slower in 256-token bins.

The probes also measure the memory a forward needs per token, which bounds a different number:
how many tokens of one document longer than a bin may run in a single forward. Such a
document runs whole when that fits (measured on P1's 1,900-token documents on a 2-core CPU:
about 5% faster than chunked prefill through a KV cache in bin-sized chunks), in chunks of
that size when it does not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vacpack.host_memory import PeakAllocation, available_host_memory_bytes, can_measure

logger = logging.getLogger(__name__)

FIRST_PROBE_TOKENS = 256
# Doubling the bin must raise tokens/s by at least this much to be worth its memory, unless a
# forward takes less than MIN_FORWARD_S; a size slower than the best by more than this share is
# not taken.
MIN_THROUGHPUT_GAIN = 0.05
# A forward this long spreads the per-bin host costs (milliseconds) thin enough.
MIN_FORWARD_S = 0.1
# Share of the memory left after loading that bins may use (the rest: logits slices, the
# packer's queue, the allocator's fragmentation).
MEMORY_MARGIN = 0.5


@dataclass(frozen=True)
class BinBudget:
    tokens: int  # the most tokens a bin of whole documents holds
    source: str
    # The most tokens of one long document a single forward may hold in the memory left;
    # equal to `tokens` where the memory per token is unknown or the budget was given.
    max_forward_tokens: int

    def __post_init__(self) -> None:
        if self.max_forward_tokens < self.tokens:
            raise ValueError(
                f"max_forward_tokens ({self.max_forward_tokens}) must be >= tokens ({self.tokens})"
            )

    @classmethod
    def given(cls, tokens: int) -> BinBudget:
        """A budget the user chose: no forward, long documents' chunks included, exceeds it."""
        return cls(tokens, "given", tokens)


def measure_bin_budget(
    forward: Callable[[int], None], device: torch.device, max_tokens: int
) -> BinBudget:
    """`forward(n)` runs one packed forward of n tokens; `max_tokens` bounds the search."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        memory_bytes = int(free_bytes * MEMORY_MARGIN)
    else:
        memory_bytes = int(available_host_memory_bytes() * MEMORY_MARGIN)
    memory_measured = device.type == "cuda" or can_measure()
    best_tokens, best_rate = 0, 0.0
    num_tokens = min(FIRST_PROBE_TOKENS, max_tokens)
    bytes_per_token = 0.0
    while True:
        try:
            rate, used_bytes = _probe(forward, device, num_tokens)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        bytes_per_token = max(bytes_per_token, used_bytes / num_tokens)
        # A best size whose forward is short pays per-bin costs the probe hardly shows, and a
        # short forward's timing is the noisiest: a larger bin replaces it whatever the rates.
        best_is_short = best_tokens > 0 and best_tokens / best_rate < MIN_FORWARD_S
        if not best_is_short and rate < best_rate * (1 - MIN_THROUGHPUT_GAIN):
            break  # slower: bins past the fastest size only cost memory
        gained = best_is_short or rate > best_rate * (1 + MIN_THROUGHPUT_GAIN)
        best_tokens, best_rate = num_tokens, rate if best_is_short else max(rate, best_rate)
        next_tokens = min(num_tokens * 2, max_tokens)
        fits = bytes_per_token * next_tokens <= memory_bytes
        short_forward = num_tokens / rate < MIN_FORWARD_S
        if not (gained or short_forward) or not fits or next_tokens == num_tokens:
            break
        num_tokens = next_tokens
    max_forward_tokens = best_tokens
    memory_text = "memory per token not measured"
    if memory_measured and bytes_per_token > 0:
        max_forward_tokens = max(best_tokens, int(memory_bytes / bytes_per_token))
        memory_text = f"~{bytes_per_token / 1024:.0f} KiB/token"
    logger.info("bin budget %d tokens: %.0f tokens/s in the probe", best_tokens, best_rate)
    return BinBudget(
        best_tokens,
        f"measured: {best_rate:,.0f} tokens/s in a probe, {memory_text}",
        max_forward_tokens,
    )


def _probe(
    forward: Callable[[int], None], device: torch.device, num_tokens: int
) -> tuple[float, float]:
    """(tokens/s of a warm forward, bytes of peak memory a forward of this size needs)."""
    # The first forward is also the warm-up (first-call allocations, kernel selection), and
    # the only one whose memory is measured: sampling it on the host costs a little time.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline_bytes = torch.cuda.memory_allocated(device)
        forward(num_tokens)
        torch.cuda.synchronize(device)
        used_bytes = torch.cuda.max_memory_allocated(device) - baseline_bytes
    else:
        with PeakAllocation() as peak:
            forward(num_tokens)
        used_bytes = peak.bytes
    # The best of two timed runs: one run on a shared machine is easily slowed by others.
    best_s = float("inf")
    for _ in range(2):
        start_s = time.perf_counter()
        forward(num_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - start_s)
    return num_tokens / best_s, float(used_bytes)
