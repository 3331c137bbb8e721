"""A cascade's merge of attention over a shared prefix into a step's output rows, in place, in
one pass of C (lse_merge.c; see there for why)."""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.token_rows import heads_side_by_side

# out, lse, rows, rows' count, prefix, prefix lse, heads, head dim, two strides, bf16, threads
_ARGTYPES = [
    *[ctypes.c_void_p] * 3,
    ctypes.c_int64,
    *[ctypes.c_void_p] * 2,
    *[ctypes.c_int64] * 4,
    ctypes.c_int,
    ctypes.c_int,
]


def _kernel() -> KernelFunction | None:
    return kernel_function("lse_merge", "merge_rows_by_lse", _ARGTYPES, portable=True)


def lse_merge_supported(out: torch.Tensor, prefix_out: torch.Tensor) -> bool:
    """Whether merge_rows_by_lse_ runs in C for these outputs."""
    return (
        out.device.type == "cpu"
        and out.dtype in (torch.bfloat16, torch.float32)
        and prefix_out.dtype == out.dtype
        and heads_side_by_side(out)
        and heads_side_by_side(prefix_out)
        and _kernel() is not None
    )


def merge_rows_by_lse_(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
) -> None:
    """out[rows] := attention over both its own keys (out[rows], lse[rows]) and a prefix's
    (prefix_out, prefix_lse), in place. out [tokens, heads, dim], lse [tokens, heads] float32;
    prefix_out [len(rows), heads, dim] in out's dtype, prefix_lse [len(rows), heads]."""
    kernel = _kernel()
    if kernel is None or not lse_merge_supported(out, prefix_out):
        raise RuntimeError("merge_rows_by_lse_ needs bf16 or float32 CPU rows of heads")
    num_heads, head_dim = out.shape[1], out.shape[2]
    if prefix_out.shape != (rows.numel(), num_heads, head_dim):
        raise ValueError(f"{list(prefix_out.shape)} prefix rows for {rows.numel()} rows")
    lse, prefix_lse = lse.float().contiguous(), prefix_lse.float().contiguous()
    rows = rows.to(torch.int64).contiguous()
    kernel(
        out.data_ptr(), lse.data_ptr(), rows.data_ptr(), rows.numel(),
        prefix_out.data_ptr(), prefix_lse.data_ptr(), num_heads, head_dim,
        out.stride(0), prefix_out.stride(0), int(out.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )  # fmt: skip
