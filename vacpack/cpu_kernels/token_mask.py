"""Token bitmasks applied to CPU logits in place, from token_mask.c (see there for why)."""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function

_LIBRARY_NAME = "token_mask"
# The bit pattern of -inf in each dtype the kernel writes.
_MINUS_INF_BITS = {torch.bfloat16: 0xFF80, torch.float16: 0xFC00, torch.float32: 0xFF800000}


# logits, rows, vocab, row stride, element size, -inf bits, bitmask, words, threads
_ARGTYPES = [
    ctypes.c_void_p,
    *[ctypes.c_int64] * 3,
    ctypes.c_int,
    ctypes.c_uint32,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int,
]


def _kernel() -> KernelFunction | None:
    return kernel_function(_LIBRARY_NAME, "apply_token_bitmask", _ARGTYPES, portable=True)


def token_mask_supported(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dtype in _MINUS_INF_BITS
        and logits.dim() == 2
        and logits.stride(1) == 1
        and _kernel() is not None
    )


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets logits[r, t] = -inf wherever bit t of row r of the int32 bitmask is 0 (in place)."""
    kernel = _kernel()
    if kernel is None or not token_mask_supported(logits):
        raise RuntimeError("apply_token_bitmask_ needs 2-D CPU logits with unit column stride")
    if bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a {list(bitmask.shape)} bitmask cannot cover {list(logits.shape)}")
    bitmask = bitmask.contiguous()
    kernel(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        logits.stride(0),
        logits.element_size(),
        _MINUS_INF_BITS[logits.dtype],
        bitmask.data_ptr(),
        bitmask.shape[1],
        torch.get_num_threads(),
    )
