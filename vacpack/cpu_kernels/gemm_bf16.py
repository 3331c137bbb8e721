"""bf16 linear layers through gemm_bf16.c (VDPBF16PS, AVX512-BF16 CPUs): bf16 inputs, weights
and outputs, float32 sums. gemm.py's GemmWeight and gemm_linear dispatch here for a weight
packed with bf16 arithmetic."""

from __future__ import annotations

import ctypes
import functools

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.profiler_range import profiler_range

LIBRARY = "gemm_bf16"
PROFILER_NAME = "vacpack::gemm_bf16"
PANEL_FEATURES = 16  # output features a panel (gemm_bf16.c's PANEL)
# The one gate the kernel finishes itself (silu(gate) * up); others run as a pass after.
GATES = ("silu",)
_INT = ctypes.c_int64
_POINTER = ctypes.c_void_p


@functools.cache
def _pack_kernel() -> KernelFunction | None:
    # w, n, k, w row stride, packed, threads
    argtypes = [_POINTER, _INT, _INT, _INT, _POINTER, ctypes.c_int]
    return kernel_function(LIBRARY, "pack_weight_bf16_pairs", argtypes)


@functools.cache
def _gemm_kernel() -> KernelFunction | None:
    # x, m, k, x row stride, packed, n, bias, gated, y, y row stride, threads
    argtypes = [_POINTER, _INT, _INT, _INT, _POINTER, _INT, _POINTER, ctypes.c_int, _POINTER]
    return kernel_function(LIBRARY, "gemm_bf16", [*argtypes, _INT, ctypes.c_int], ctypes.c_int)


def supported() -> bool:
    """Whether the kernel runs here: an AVX512-BF16 CPU and a C compiler."""
    return _gemm_kernel() is not None and _pack_kernel() is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] bf16 (rows stride(0) apart, columns adjacent) in the kernel's panels:
    [ceil(out / 16)][ceil(in / 2)][16][2], zeros past out and in."""
    kernel = _pack_kernel()
    if kernel is None:
        raise RuntimeError("the gemm_bf16 kernel does not run here")
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_FEATURES)
    panels = torch.empty(
        num_panels * -(-in_features // 2) * 2 * PANEL_FEATURES, dtype=torch.bfloat16
    )
    kernel(
        weight.data_ptr(),
        out_features,
        in_features,
        weight.stride(0),
        panels.data_ptr(),
        torch.get_num_threads(),
    )
    return panels


def linear(
    rows: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    gated: bool,
) -> torch.Tensor:
    """rows [m, in] bf16 (columns adjacent) @ W^T + bias (float32, out_features values), or
    silu(gate) * up where `gated` (panels and bias paired: gemm.pair_halves), as
    [m, out_features] bf16."""
    kernel = _gemm_kernel()
    if kernel is None:
        raise RuntimeError("the gemm_bf16 kernel does not run here")
    out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    if rows.shape[0]:
        with profiler_range(PROFILER_NAME):
            kernel(
                rows.data_ptr(),
                rows.shape[0],
                rows.shape[1],
                rows.stride(0),
                panels.data_ptr(),
                out_features,
                bias.data_ptr() if bias is not None else None,
                gated,
                out.data_ptr(),
                out.stride(0),
                torch.get_num_threads(),
            )
    return out
