"""Row-wise argmax of bf16 logits on CPUs, from argmax.c: greedy sampling without a float32
copy of the [rows, vocab] logits (see argmax.c for why)."""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function

_LIBRARY_NAME = "argmax"


# x, rows, columns, row stride, out, threads
_ARGTYPES = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int]


def _kernel() -> KernelFunction | None:
    return kernel_function(_LIBRARY_NAME, "argmax_bf16", _ARGTYPES)


def argmax_supported(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.bfloat16
        and logits.dim() == 2
        and _kernel() is not None
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of a [rows, columns] bf16 CPU tensor, as int64."""
    kernel = _kernel()
    if kernel is None or not argmax_supported(logits):
        raise RuntimeError("argmax_rows needs a 2-D bf16 CPU tensor and the compiled kernel")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        logits.stride(0),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
