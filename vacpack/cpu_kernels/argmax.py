"""Row-wise argmax of logits on CPUs: greedy sampling without PyTorch's scalar argmax. bf16
from argmax.c (AVX-512, no float32 copy of the [rows, vocab] logits), float32 from
argmax_f32.c (plain C vectorised for the CPU at hand: any CPU with a C compiler)."""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function

# x, rows, columns, row stride, out, threads
_ARGTYPES = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int]
# Per dtype: the library, its function, and whether it is portable (built for any CPU).
_LIBRARIES: dict[torch.dtype, tuple[str, str, bool]] = {
    torch.bfloat16: ("argmax", "argmax_bf16", False),
    torch.float32: ("argmax_f32", "argmax_f32", True),
}


def _kernel(dtype: torch.dtype) -> KernelFunction | None:
    if dtype not in _LIBRARIES:
        return None
    library, function, portable = _LIBRARIES[dtype]
    return kernel_function(library, function, _ARGTYPES, portable=portable)


def argmax_supported(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dim() == 2 and _kernel(logits.dtype) is not None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of a [rows, columns] bf16 or float32 CPU tensor, as
    int64."""
    kernel = _kernel(logits.dtype)
    if kernel is None or not argmax_supported(logits):
        raise RuntimeError("argmax_rows needs a 2-D bf16 or float32 CPU tensor and its kernel")
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
