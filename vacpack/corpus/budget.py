"""The bin budget: how many tokens one packed forward may hold, measured on the device.

Probe forwards at doubling sizes are timed (and, on CUDA, run until memory runs out). The
budget is the largest probed size that fits in memory with a margin and is not slower than
the best. The search goes on while doubling the bin raises throughput, and, gain or not, while
a forward is short: every bin also pays fixed host costs that a probe of long sequences hardly
shows (attention metadata, a few hundred kernel calls from Python, pooling or the LM head's
passes), and on a CPU each doubling of a GEMM's rows gains a few percent, under the tolerance
each time but not in sum (E1's texts, 2-core AMD EPYC, best of 5 interleaved jobs: 512-token
bins 8.2 s, 1,024 8.0 s, 4,096 7.7 s, 16,384 7.6 s). A search that stopped at the first
doubling under the tolerance once ended at 1,024 tokens on E1, and one noisy reading of a
256-token probe once ended it at 256 (the job then ran about 1.2x slower): a size whose
forward is too short to time well is never the budget while a larger one fits, and a size
measured slower is timed again, right after the best size is, before it ends the search.

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
# A size slower than the best by more than this share ends the search; once forwards are
# long, a doubling must gain this much to be worth its memory.
THROUGHPUT_TOLERANCE = 0.05
# Timings of a forward shorter than this are too noisy to stop on: a best size this short is
# replaced by the next one whatever their rates.
NOISY_FORWARD_S = 0.1
# The search doubles on while a forward is shorter than this, unless a size is slower: per-bin
# host costs (milliseconds) and the GEMMs' small gains per doubling add up below it.
SHORT_FORWARD_S = 0.5
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
            used_bytes = _warm_up(forward, device, num_tokens)
            rate = _rate(forward, device, num_tokens)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        bytes_per_token = max(bytes_per_token, used_bytes / num_tokens)
        best_is_noisy = best_tokens > 0 and best_tokens / best_rate < NOISY_FORWARD_S
        if not best_is_noisy and _slower(rate, best_rate):
            # Both sizes once more, one right after the other, before this ends the search: a
            # shared host's noise only ever slows, and a slow spell of a few seconds slows
            # every reading of the size probed in it.
            best_rate = max(best_rate, _rate(forward, device, best_tokens))
            rate = max(rate, _rate(forward, device, num_tokens))
            if _slower(rate, best_rate):
                break  # bins past the fastest size only cost memory
        gained = best_is_noisy or rate > best_rate * (1 + THROUGHPUT_TOLERANCE)
        best_tokens, best_rate = num_tokens, rate if best_is_noisy else max(rate, best_rate)
        next_tokens = min(num_tokens * 2, max_tokens)
        fits = bytes_per_token * next_tokens <= memory_bytes
        short_forward = num_tokens / rate < SHORT_FORWARD_S
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


def _slower(rate: float, best_rate: float) -> bool:
    return rate < best_rate * (1 - THROUGHPUT_TOLERANCE)


def _warm_up(forward: Callable[[int], None], device: torch.device, num_tokens: int) -> float:
    """Bytes of peak memory a forward of this size needs, measured on its first run (also the
    warm-up: first-call allocations, kernel selection). Sampling memory on the host costs a
    little time, so this run is not timed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline_bytes = torch.cuda.memory_allocated(device)
        forward(num_tokens)
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - baseline_bytes)
    with PeakAllocation() as peak:
        forward(num_tokens)
    return float(peak.bytes)


def _rate(forward: Callable[[int], None], device: torch.device, num_tokens: int) -> float:
    """Tokens/s of a warm forward, the best of two runs: one run on a shared machine is easily
    slowed by others."""
    best_s = float("inf")
    for _ in range(2):
        start_s = time.perf_counter()
        forward(num_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - start_s)
    return num_tokens / best_s
