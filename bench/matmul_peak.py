"""The machine's linear-layer peak: the best TFLOPS of one matmul shape, timed with a host clock on
a CPU (both `F.linear` and oneDNN on a prepacked weight, as vacpack runs it) and with CUDA events
on a GPU. The benchmarks divide their own FLOP rates by it (MFU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from vacpack.models.cpu_prepack import packed_linear, prepack

MATMUL_WARMUP_REPS = 2
# Best of many: on a shared machine most repetitions are slowed by other work.
MATMUL_TIMED_REPS = 10

# On CUDA one F.linear at a prefill shape takes well under a millisecond: each timed repetition
# runs this many back to back between two CUDA events, so launch gaps and event resolution vanish.
MATMUL_CUDA_CALLS_PER_REP = 20


def best_linear_tflops(
    num_rows: int,
    in_features: int,
    out_features: int,
    generator: torch.Generator,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Best linear-layer TFLOPS (bfloat16 unless `dtype` says) over MATMUL_TIMED_REPS runs at
    one shape.

    On a CPU both ways of running the layer are timed, `F.linear` and oneDNN on a prepacked
    weight (what vacpack runs), and the faster counts: the peak is the best this machine does.
    On CUDA the kernels run asynchronously, so a host clock around the call would time only the
    launch: each repetition is timed with CUDA events around MATMUL_CUDA_CALLS_PER_REP calls,
    after a synchronize, and read after the end event has completed.
    """
    x = torch.randn(num_rows, in_features, generator=generator).to(device, dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(device, dtype)
    flops = 2 * num_rows * in_features * out_features
    result: dict[str, Any] = {
        "shape": f"[{num_rows}, {in_features}] x [{in_features}, {out_features}]",
        "device": device,
    }
    if device.startswith("cuda"):
        for _ in range(MATMUL_WARMUP_REPS):
            torch.nn.functional.linear(x, weight)
        best_s = min(_cuda_linear_times_s(x, weight))
    else:
        best_s = min(_cpu_linear_times_s(lambda: torch.nn.functional.linear(x, weight)))
        result["f_linear_tflops"] = flops / best_s / 1e12
        packed = prepack(weight)
        if packed is not None:
            packed_s = min(_cpu_linear_times_s(lambda: packed_linear(x, packed, None)))
            result["prepacked_tflops"] = flops / packed_s / 1e12
            best_s = min(best_s, packed_s)
    return {**result, "best_s": best_s, "best_tflops": flops / best_s / 1e12}


def _cpu_linear_times_s(linear: Callable[[], torch.Tensor]) -> list[float]:
    for _ in range(MATMUL_WARMUP_REPS):
        linear()
    times_s = []
    for _ in range(MATMUL_TIMED_REPS):
        start_s = time.perf_counter()
        linear()
        times_s.append(time.perf_counter() - start_s)
    return times_s


def _cuda_linear_times_s(x: torch.Tensor, weight: torch.Tensor) -> list[float]:
    """Seconds per call, one value per repetition, from CUDA events on the current stream."""
    torch.cuda.synchronize(x.device)  # the warm-up calls and the input copies are done
    times_s = []
    for _ in range(MATMUL_TIMED_REPS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(MATMUL_CUDA_CALLS_PER_REP):
            torch.nn.functional.linear(x, weight)
        end.record()
        end.synchronize()
        times_s.append(start.elapsed_time(end) / 1e3 / MATMUL_CUDA_CALLS_PER_REP)
    return times_s
