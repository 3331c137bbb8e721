"""Decode attention read in place from a paged KV cache, from paged_decode.c: plain C that the
compiler vectorises for the CPU at hand, so it runs on every CPU (see paged_decode.c); and for
bf16 models two more implementations of the same call: paged_decode_bf16.c on the bf16
dot-product instruction (x86 with AVX512-BF16) and paged_decode_amx.c on AMX tiles."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.build import (
    AMX,
    EMULATED_DPBF16,
    EMULATED_TILES,
    BuildVariant,
    KernelFunction,
    ProvenKernel,
    kernel_function,
    proven_kernel,
)
from vacpack.cpu_kernels.cache_dtype import check_cache_dtype

_LIBRARY_NAME = "paged_decode"
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
# The kernels' fixed per-task buffers (paged_decode.c, paged_decode_bf16.c, paged_decode_amx.c).
MAX_GROUP = 16
MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Bf16DecodeKernel:
    """One of the bf16-only implementations: its library (source file), its build, the multiple
    of head_dim it takes, and the function that asks the OS for CPU state first, if any."""

    library: str
    variant: BuildVariant | None
    portable: bool  # built for any CPU (an emulation), else for the CPU flags it needs
    head_dim_multiple: int
    ready_function: str | None = None


# By name: the bf16 dot-product instruction's kernel, on AVX512-BF16 ("avx512_bf16") or with
# the instruction emulated in plain C ("emulated_dpbf16", any CPU: tests); the AMX kernel, on the
# CPU's tiles ("amx") or with the tile instructions emulated ("emulated_tiles").
BF16_DECODE_KERNELS = {
    "avx512_bf16": Bf16DecodeKernel("paged_decode_bf16", None, False, 16),
    "emulated_dpbf16": Bf16DecodeKernel("paged_decode_bf16", EMULATED_DPBF16, True, 16),
    "amx": Bf16DecodeKernel("paged_decode_amx", AMX, False, 32, "paged_decode_amx_ready"),
    "emulated_tiles": Bf16DecodeKernel(
        "paged_decode_amx", EMULATED_TILES, True, 32, "paged_decode_amx_ready"
    ),
}
# The self-check's largest difference from float32 attention that bf16 rounding explains
# (probabilities rounded to bf16, and the output: about 0.004 on its inputs).
SELF_CHECK_TOLERANCE = 0.03


_ARGTYPES = [
    *[_POINTER] * 7,  # q, keys, values, pages, key ranges, out, lse (or NULL)
    *[_INT] * 6,  # seqs, heads, kv heads, head_dim, page size, pages per seq
    ctypes.c_float,  # scale
    ctypes.c_int,  # queries and output bf16 (else float32)
    ctypes.c_int,  # the cache bf16 (else float32)
    ctypes.c_int,  # heads in lanes (else apart)
    ctypes.c_int,  # threads
]


_BF16_ARGTYPES = [
    *[_POINTER] * 7,  # q, keys, values, pages, key ranges, out, lse (or NULL)
    *[_INT] * 6,  # seqs, heads, kv heads, head_dim, page size, pages per seq
    ctypes.c_float,  # scale
    ctypes.c_int,  # threads
]


def _kernel() -> KernelFunction | None:
    return kernel_function(
        _LIBRARY_NAME, "paged_decode_attention", _ARGTYPES, ctypes.c_int, portable=True
    )


@functools.cache
def _bf16_kernel(name: str) -> KernelFunction | None:
    """The bf16 kernel `name` (BF16_DECODE_KERNELS), once it builds, the CPU state it needs is
    granted, and it has computed a few decodes like float32 attention (build.proven_kernel)."""
    if name not in BF16_DECODE_KERNELS:
        raise ValueError(f"bf16_kernel must be one of {tuple(BF16_DECODE_KERNELS)}, got {name!r}")
    spec = BF16_DECODE_KERNELS[name]
    return proven_kernel(
        ProvenKernel(
            library=spec.library,
            function=spec.library,
            argtypes=_BF16_ARGTYPES,
            portable=spec.portable,
            variant=spec.variant,
            ready_function=spec.ready_function,
            self_check=_self_check,
            tolerance=SELF_CHECK_TOLERANCE,
            label=f"{name} decode attention",
        )
    )


# The self-check's decodes: (query heads, KV heads, head_dim, page size). 4 on 2 of 64 over
# 16-token pages (the kernels' specialised head size, tiles read in place); 12 on 1 of 96 over
# 8-token pages (a general head size, a second lane group, the AMX kernel's last value pass of
# two tiles, every tile copied).
SELF_CHECK_SHAPES = ((4, 2, 64, 16), (12, 1, 96, 8))


def _self_check(kernel: KernelFunction) -> float:
    """The largest difference between `kernel` and float32 attention in bf16, over each of
    SELF_CHECK_SHAPES: three decodes (5 keys; 40 keys past a window's start inside a page; 600
    keys, split over two tasks) on shuffled pages."""
    worst = 0.0
    for num_heads, num_kv_heads, head_dim, page_size in SELF_CHECK_SHAPES:
        generator = torch.Generator().manual_seed(head_dim)
        key_ranges = torch.tensor([[0, 5], [3, 40], [0, 600]], dtype=torch.int64)
        pages_per_seq = -(-600 // page_size)
        pages = torch.randperm(3 * pages_per_seq, generator=generator).view(3, pages_per_seq)
        cache_shape = (3 * pages_per_seq * page_size, num_kv_heads, head_dim)
        keys, values = (torch.randn(cache_shape, generator=generator).bfloat16() for _ in "kv")
        q = torch.randn(3, num_heads, head_dim, generator=generator).bfloat16()
        out = torch.empty_like(q)
        status = kernel(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), pages.data_ptr(),
            key_ranges.data_ptr(), out.data_ptr(), None, 3, num_heads, num_kv_heads, head_dim,
            page_size, pages_per_seq, head_dim**-0.5, 8,
        )  # fmt: skip
        if status != 0:
            return float("inf")
        for seq, (first, num_keys) in enumerate(key_ranges.tolist()):
            positions = torch.arange(first, num_keys)
            slots = pages[seq, positions // page_size] * page_size + positions % page_size
            attended = torch.nn.functional.scaled_dot_product_attention(
                q[seq].float().unsqueeze(1),  # [heads, 1 query, head_dim]
                keys[slots].float().transpose(0, 1),
                values[slots].float().transpose(0, 1),
                enable_gqa=True,
            )
            worst = max(worst, float((out[seq].float() - attended.squeeze(1)).abs().max()))
    return worst


def bf16_decode_ready(bf16_kernel: str) -> bool:
    """Whether the bf16 kernel `bf16_kernel` (BF16_DECODE_KERNELS) runs here: it builds, the CPU
    has its instructions, and it passed its self-check."""
    return _bf16_kernel(bf16_kernel) is not None


def paged_decode_supported(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bf16_kernel: str | None = None,
) -> bool:
    """Whether the kernel runs these decodes here (CPU, float32 or bf16, head_dim a multiple of
    8 for its 8-lane vectors, within its buffers); with `bf16_kernel`, that implementation (bf16
    queries and cache, head_dim a multiple of its own)."""
    if bf16_kernel is not None:
        if bf16_kernel not in BF16_DECODE_KERNELS:
            raise ValueError(
                f"bf16_kernel must be one of {tuple(BF16_DECODE_KERNELS)}, got {bf16_kernel!r}"
            )
        multiple = BF16_DECODE_KERNELS[bf16_kernel].head_dim_multiple
        if dtype != torch.bfloat16 or head_dim % multiple:
            return False
    return (
        device.type == "cpu"
        and dtype in _DTYPES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % 8 == 0
        and (_kernel() if bf16_kernel is None else _bf16_kernel(bf16_kernel)) is not None
    )


def _check_layout(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pages: torch.Tensor,
    key_ranges: torch.Tensor,
) -> None:
    """What the C kernels read as raw memory, checked first: a wrong dtype or shape there would
    read outside the cache rather than fail."""
    num_seqs, _, head_dim = q.shape
    if keys.dim() != 3 or keys.shape[2] != head_dim or values.shape != keys.shape:
        raise ValueError(
            f"keys and values must both be [slots, kv_heads, {head_dim}], got "
            f"{tuple(keys.shape)} and {tuple(values.shape)}"
        )
    for name, table in (("pages", pages), ("key_ranges", key_ranges)):
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != num_seqs:
            raise ValueError(
                f"{name} must be int64 [{num_seqs}, ...], got {table.dtype} {tuple(table.shape)}"
            )
    if key_ranges.shape[1] != 2:
        raise ValueError(f"key_ranges must be [{num_seqs}, 2], got {tuple(key_ranges.shape)}")
    for name, tensor in (("keys", keys), ("values", values), ("pages", pages)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


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
    bf16_kernel: str | None = None,
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

    bf16_kernel (a name of BF16_DECODE_KERNELS): that bf16-only implementation instead, where
    it runs (heads_in_lanes does not apply: the VDPBF16PS kernel keeps the heads in lanes, the
    AMX kernel takes its scores keys by heads on the tiles).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    if not paged_decode_supported(
        q.device, q.dtype, num_heads, num_kv_heads, head_dim, bf16_kernel
    ):
        raise RuntimeError("the paged decode kernel cannot run these decodes here")
    check_cache_dtype(q.dtype, keys.dtype, values.dtype)
    _check_layout(q, keys, values, pages, key_ranges)
    q = q.contiguous()
    key_ranges = key_ranges.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(num_seqs, num_heads, dtype=torch.float32) if with_lse else None
    if bf16_kernel is not None:
        bf16_function = _bf16_kernel(bf16_kernel)
        assert bf16_function is not None  # supported
        status = bf16_function(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), pages.data_ptr(),
            key_ranges.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, page_size, pages.shape[1], scale,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"the {bf16_kernel} decode kernel could not allocate its buffers")
        return out, lse
    kernel = _kernel()
    assert kernel is not None  # supported
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
