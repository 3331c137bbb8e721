"""How many KV pages fit: from memory measured after the model is loaded, never a constant."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vacpack.host_memory import available_host_memory_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSizing:
    num_pages: int
    budget_bytes: int
    source: str  # how the budget was found, for the report


def size_kv_cache(
    *,
    device: torch.device,
    bytes_per_token: int,
    page_size: int,
    max_model_len: int,
    pages_per_sequence: int,
    max_num_seqs: int,
    explicit_budget_bytes: int | None,
    gpu_memory_utilization: float,
    cpu_kv_cache_fraction: float,
    profile_forward: Callable[[], None],
) -> KVSizing:
    """Pages for the KV cache.

    Explicit budget: used as given. CUDA: run `profile_forward` (a forward at the largest step
    shape) to measure peak activation memory, then give the KV cache what is left of
    `gpu_memory_utilization` of the device. CPU: a fraction of the RAM still available after
    the model was loaded. Never more than max_num_seqs sequences could hold, and at least
    what one holds (`pages_per_sequence`: its whole context, or, when every layer has a sliding
    window, the window and a step's tokens), so that every sequence can run.
    """
    bytes_per_page = bytes_per_token * page_size
    if explicit_budget_bytes is not None:
        budget, source = explicit_budget_bytes, "kv_cache_memory_bytes"
    elif device.type == "cuda":
        budget, source = (
            _cuda_budget(device, gpu_memory_utilization, profile_forward),
            (f"measured: {gpu_memory_utilization:.0%} of device memory after a profile forward"),
        )
    else:
        budget = int(available_host_memory_bytes() * cpu_kv_cache_fraction)
        source = f"{cpu_kv_cache_fraction:.0%} of available host memory"
    num_pages = min(budget // bytes_per_page, pages_per_sequence * max_num_seqs)
    if num_pages < pages_per_sequence:
        raise ValueError(
            f"the KV cache budget ({budget / 2**20:.1f} MiB, {source}) holds "
            f"{num_pages * page_size} tokens, fewer than one sequence of max_model_len="
            f"{max_model_len} holds at once ({pages_per_sequence * page_size}); give the cache "
            "more memory or lower max_model_len"
        )
    return KVSizing(num_pages=int(num_pages), budget_bytes=int(budget), source=source)


def _cuda_budget(
    device: torch.device, utilization: float, profile_forward: Callable[[], None]
) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward()
    torch.cuda.synchronize(device)
    peak_torch_bytes = torch.cuda.max_memory_allocated(device)
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    # Memory held outside torch's allocator (CUDA context, other processes) is total - free
    # minus what torch itself has reserved.
    non_torch_bytes = total_bytes - free_bytes - torch.cuda.memory_reserved(device)
    budget = int(total_bytes * utilization) - peak_torch_bytes - non_torch_bytes
    logger.info(
        "CUDA memory: total %.1f GiB, torch peak %.2f GiB, other %.2f GiB -> KV %.2f GiB",
        total_bytes / 2**30,
        peak_torch_bytes / 2**30,
        non_torch_bytes / 2**30,
        budget / 2**30,
    )
    return max(budget, 0)
