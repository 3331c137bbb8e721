"""Decode attention read in place from a paged KV cache, from paged_decode.c: plain C that the
compiler vectorises for the CPU at hand, so it runs on every CPU (see paged_decode.c)."""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.cache_dtype import check_cache_dtype

_LIBRARY_NAME = "paged_decode"
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
# The kernel's fixed per-task buffers (paged_decode.c).
MAX_GROUP = 16
MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16)


_ARGTYPES = [
    *[_POINTER] * 7,  # q, keys, values, pages, key ranges, out, lse (or NULL)
    *[_INT] * 6,  # seqs, heads, kv heads, head_dim, page size, pages per seq
    ctypes.c_float,  # scale
    ctypes.c_int,  # queries and output bf16 (else float32)
    ctypes.c_int,  # the cache bf16 (else float32)
    ctypes.c_int,  # heads in lanes (else apart)
    ctypes.c_int,  # threads
]


def _kernel() -> KernelFunction | None:
    return kernel_function(
        _LIBRARY_NAME, "paged_decode_attention", _ARGTYPES, ctypes.c_int, portable=True
    )


def paged_decode_supported(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the kernel runs these decodes here (CPU, float32 or bf16, head_dim a multiple of
    8 for its 8-lane vectors, within its buffers)."""
    return (
        device.type == "cpu"
        and dtype in _DTYPES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % 8 == 0
        and _kernel() is not None
    )


def paged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pages: torch.Tensor,
    key_ranges: torch.Tensor,
    page_size: int,
    scale: float,
    with_lse: bool = False,
    heads_in_lanes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of decode queries q [seqs, heads, head_dim] over their cached keys;
    with_lse: also each head's float32 log-sum-exp of its scaled scores, [seqs, heads] (what a
    cascade merges by).

    keys and values: one layer's cache, [slots, kv_heads, head_dim], in q's dtype, or bf16
    under float32 queries (a cache kept in bf16 for float32 arithmetic). pages:
    [seqs, pages per seq] int64 page ids (padding past a sequence's keys is never read).
    key_ranges: [seqs, 2] int64, each sequence's first visible key (past a sliding window's
    start, else 0) and its number of keys; at least one key is visible. Query head h reads KV
    head h // (heads // kv_heads).

    heads_in_lanes picks the kernel's form: each KV head's grouped query heads in vector lanes
    (one vector per key holds up to eight heads' scores: no horizontal sums, a group of fewer
    than eight leaves lanes idle), else apart (each head's dot products along head_dim).
    Which is faster depends on the group size and the CPU: the engine times both.
    """
    kernel = _kernel()
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    if kernel is None or not paged_decode_supported(
        q.device, q.dtype, num_heads, num_kv_heads, head_dim
    ):
        raise RuntimeError("the paged decode kernel cannot run these decodes here")
    check_cache_dtype(q.dtype, keys.dtype, values.dtype)
    for name, tensor in (("keys", keys), ("values", values), ("pages", pages)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    q = q.contiguous()
    key_ranges = key_ranges.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float32) if with_lse else None
    status = kernel(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        pages.data_ptr(),
        key_ranges.data_ptr(),
        out.data_ptr(),
        None if lse is None else lse.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pages.shape[1],
        scale,
        int(q.dtype == torch.bfloat16),
        int(keys.dtype == torch.bfloat16),
        int(heads_in_lanes),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the paged decode kernel could not allocate its task buffers")
    return out, lse
