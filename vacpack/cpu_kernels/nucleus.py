"""The top-p (nucleus) boundary of float32 CPU logits rows without sorting them (nucleus.c):
three reads of each row and a sort of one histogram bin, any CPU with a C compiler."""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.profiler_range import profiler_range

LIBRARY = "nucleus"
PROFILER_NAME = "vacpack::nucleus_cut"
# logits, rows, vocab, row stride, top_p, cut out, threads
_ARGTYPES = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def _kernel() -> KernelFunction | None:
    return kernel_function(LIBRARY, "nucleus_cut_f32", _ARGTYPES, ctypes.c_int, portable=True)


def nucleus_cut_supported(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and _kernel() is not None
    )


def nucleus_cut(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest logit of its top-p nucleus (the shortest most-likely-first prefix
    whose softmax mass reaches top_p: a token stays while the mass strictly before it is below
    p), -inf where every token stays, NaN for a row without a finite maximum or with a NaN.
    Cutting at it (x < cut -> -inf) keeps tokens tied with the boundary."""
    kernel = _kernel()
    if kernel is None or not nucleus_cut_supported(logits):
        raise RuntimeError("nucleus_cut needs a 2-D float32 CPU tensor and its kernel")
    num_rows, vocab = logits.shape
    if top_p.shape != (num_rows,):
        raise ValueError(f"top_p {tuple(top_p.shape)} for {num_rows} rows")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    top_p = top_p.to(device="cpu", dtype=torch.float32).contiguous()
    cut = torch.empty(num_rows, dtype=torch.float32)
    if num_rows:
        with profiler_range(PROFILER_NAME):
            status = kernel(
                logits.data_ptr(),
                num_rows,
                vocab,
                logits.stride(0),
                top_p.data_ptr(),
                cut.data_ptr(),
                torch.get_num_threads(),
            )
        if status != 0:
            raise MemoryError("nucleus_cut could not allocate its scratch (a histogram and a row)")
    return cut
