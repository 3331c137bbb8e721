"""Attention on CPUs in one C call per batch: packed variable-length sequences, and queries
over a paged KV cache (with log-sum-exp, for cascades). bf16 from varlen_attention.c (x86 with
AVX512-BF16) or varlen_attention_amx.c (its products on AMX tiles, x86 with AMX), float32 from
varlen_attention_f32.c (plain C vectorised for the CPU at hand: any CPU with a C compiler).

PyTorch's CPU attention kernel runs at a fraction of the CPU's matmul speed on small heads:
with 32-dim heads (all-MiniLM-L6-v2) it is bound by its float32 exponentials and the
[queries, keys] matrices it writes, and with 64-dim grouped heads (Qwen2.5-0.5B) it measured
50-130 GFLOPS in bf16. The C kernels keep a block of scores in registers and cache, use a
polynomial exp2 (and in bf16 the CPU's bf16 dot-product instruction for both products), and
read the packed token stream or the cache's pages directly: one call per batch, no padding, no
gathers. Which of them runs a model's attention is measured against PyTorch's paths
(vacpack/attention/selection.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vacpack.cpu_kernels.build import (
    AMX,
    EMULATED_TILES,
    KernelFunction,
    ProvenKernel,
    kernel_function,
    proven_kernel,
)
from vacpack.cpu_kernels.cache_dtype import check_cache_dtype
from vacpack.cpu_kernels.new_kv import NEW_SLOT_OUTSIDE_CACHE, NO_NEW_KV, NewKV, stored_rows
from vacpack.cpu_kernels.packed_keys import packed_key_shape
from vacpack.cpu_kernels.profiler_range import profiler_range
from vacpack.cpu_kernels.token_rows import rows_of_heads

# Per dtype: the library, whether it is portable (built for any CPU), its function, and the
# multiple of head_dim it takes (the bf16 value product works on 32 dims at a time, the float32
# kernel on 8-lane vectors).
_LIBRARIES: dict[torch.dtype, tuple[str, bool, str, int]] = {
    torch.bfloat16: ("varlen_attention", False, "varlen_attention_bf16", 32),
    torch.float32: ("varlen_attention_f32", True, "varlen_attention_f32", 8),
}
# The bf16 kernel's two implementations, either of which may be the faster on a CPU that has
# both (selection.py measures which): its products as AVX-512 VDPBF16PS on registers, or on AMX
# tiles. "emulated_tiles" is the AMX kernel with its tile instructions run in plain C, on any
# CPU: slow, for tests of the AMX kernel on machines without AMX.
BF16_KERNELS = ("avx512_bf16", "amx")
DEFAULT_BF16_KERNEL = "avx512_bf16"
_TILE_KERNELS = {"amx": AMX, "emulated_tiles": EMULATED_TILES}
MAX_HEAD_DIM = 256
PROFILER_NAME = "vacpack::varlen_attention"


_ARGTYPES = [
    *[ctypes.c_void_p] * 6,  # q, k, v, out, cu_q, cu_k
    *[ctypes.c_int64] * 8,  # sequences, heads, KV heads, head dim, four row strides
    ctypes.c_void_p,  # page tables, or None
    *[ctypes.c_int64] * 2,  # page table row stride, page size
    ctypes.c_int,  # keys packed (a cache that keeps them so: vacpack/kvcache/paged_cache.py)
    ctypes.c_void_p,  # log-sum-exp out, or None
    ctypes.c_float,  # scale
    ctypes.c_int,  # causal
    ctypes.c_int,  # keys and values bf16 (else float32)
    ctypes.c_int,  # threads
    *[ctypes.c_void_p] * 3,  # a step's new keys, values and their slots to store first, or None
    *[ctypes.c_int64] * 4,  # their number, key and value row strides; the cache's slots
]


def _kernel(dtype: torch.dtype, bf16_kernel: str = DEFAULT_BF16_KERNEL) -> KernelFunction | None:
    if dtype not in _LIBRARIES:
        return None
    if dtype == torch.bfloat16 and bf16_kernel != DEFAULT_BF16_KERNEL:
        if bf16_kernel not in _TILE_KERNELS:
            raise ValueError(f"bf16_kernel must be one of {BF16_KERNELS}, got {bf16_kernel!r}")
        return _tile_kernel(bf16_kernel)
    library, portable, function, _ = _LIBRARIES[dtype]
    return kernel_function(library, function, _ARGTYPES, ctypes.c_int, portable=portable)


@functools.cache
def _tile_kernel(name: str) -> KernelFunction | None:
    """The AMX kernel (or its emulation), once the process may use the tiles and the kernel
    has computed a small attention like the float32 reference (build.proven_kernel)."""
    return proven_kernel(
        ProvenKernel(
            library="varlen_attention_amx",
            function="varlen_attention_amx",
            argtypes=_ARGTYPES,
            portable=name == "emulated_tiles",
            variant=_TILE_KERNELS[name],
            ready_function="varlen_attention_amx_ready",
            self_check=_self_check,
            tolerance=SELF_CHECK_TOLERANCE,
            label=f"AMX attention ({name})",
        )
    )


# The self-check's largest difference from the float32 reference that bf16 rounding explains
# (the AVX-512 kernel's is about 0.004 on its inputs).
SELF_CHECK_TOLERANCE = 0.03


def _self_check(kernel: KernelFunction) -> float:
    """The largest difference between `kernel` and float32 attention on two causal sequences
    of 19 and 45 tokens, 4 query heads on 2 KV heads of 64 dims, in bf16."""
    generator = torch.Generator().manual_seed(0)
    seq_lens, num_heads, num_kv_heads, head_dim = (19, 45), 4, 2, 64
    num_tokens = sum(seq_lens)
    q, k, v = (
        torch.randn(num_tokens, heads, head_dim, generator=generator).to(torch.bfloat16)
        for heads in (num_heads, num_kv_heads, num_kv_heads)
    )
    cu_seqlens = torch.tensor([0, seq_lens[0], num_tokens], dtype=torch.int64)
    out = torch.empty_like(q)
    status = kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        cu_seqlens.data_ptr(), cu_seqlens.data_ptr(), len(seq_lens),
        num_heads, num_kv_heads, head_dim,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        None, 0, 0, 0, None, head_dim**-0.5, 1, 1, 1, *NO_NEW_KV,
    )  # fmt: skip
    if status != 0:
        return float("inf")
    expected = []
    for rows in (slice(0, seq_lens[0]), slice(seq_lens[0], num_tokens)):
        heads_first = [x[rows].float().transpose(0, 1) for x in (q, k, v)]
        attended = F.scaled_dot_product_attention(
            heads_first[0], heads_first[1], heads_first[2], is_causal=True, enable_gqa=True
        )
        expected.append(attended.transpose(0, 1))
    return float((out.float() - torch.cat(expected)).abs().max())


def tile_kernel_ready(bf16_kernel: str = "amx") -> bool:
    """Whether the AMX attention kernel ("amx") or its emulation ("emulated_tiles") runs here:
    it builds, the CPU has the tiles, and it passed its self-check."""
    return _tile_kernel(bf16_kernel) is not None


def head_dim_multiple(dtype: torch.dtype) -> int:
    """The kernel of `dtype` takes head sizes that are a multiple of this (0: no kernel)."""
    return _LIBRARIES[dtype][3] if dtype in _LIBRARIES else 0


def varlen_attention_supported(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    bf16_kernel: str = DEFAULT_BF16_KERNEL,
) -> bool:
    """Whether varlen_attention runs here for tensors of this device, dtype and head size (in
    bf16, on the implementation `bf16_kernel`)."""
    multiple = head_dim_multiple(dtype)
    return (
        device.type == "cpu"
        and multiple > 0
        and head_dim % multiple == 0
        and head_dim <= MAX_HEAD_DIM
        and _kernel(dtype, bf16_kernel) is not None
    )


@dataclass(frozen=True)
class KernelSequences:
    """A batch's sequences as the kernel reads them, checked once: every layer of an engine
    step (or of a corpus bin) reuses them, so no layer pays for building or checking them."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int64: sequence b's query rows
    # [num_seqs + 1] int64: key rows of the stream, or with page_tables each sequence's key count
    cu_seqlens_k: torch.Tensor
    page_tables: torch.Tensor | None  # [num_seqs, max_pages] int64, or None for stream rows
    page_size: int
    causal: bool

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.numel() - 1


def packed_sequences(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, causal: bool
) -> KernelSequences:
    """Sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows
    cu_seqlens_k[b]:cu_seqlens_k[b+1] of the token streams."""
    return _checked(cu_seqlens_q, cu_seqlens_k, None, 0, causal)


def paged_sequences(
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    page_tables: torch.Tensor,
    page_size: int,
    *,
    causal: bool = True,
) -> KernelSequences:
    """Sequence b's queries (rows cu_seqlens_q[b]:cu_seqlens_q[b+1]) attend to its
    context_lens[b] keys in the slots of the pages page_tables[b] ([num_seqs, max_pages],
    padded anywhere past the context)."""
    cu_k = F.pad(context_lens.to(torch.int64).cumsum(0), (1, 0))
    return _checked(cu_seqlens_q, cu_k, page_tables, page_size, causal)


def _checked(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    page_tables: torch.Tensor | None,
    page_size: int,
    causal: bool,
) -> KernelSequences:
    cu_q = cu_seqlens_q.to(torch.int64).contiguous()
    cu_k = cu_seqlens_k.to(torch.int64).contiguous()
    num_seqs = cu_q.numel() - 1
    if cu_k.numel() != num_seqs + 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k describe different numbers of sequences")
    if causal and bool(((cu_k.diff() - cu_q.diff()) < 0).any()):
        raise ValueError("causal attention needs at least as many keys as queries per sequence")
    if page_tables is not None:
        page_tables = page_tables.to(torch.int64).contiguous()
        if page_tables.shape[0] != num_seqs or page_size <= 0:
            raise ValueError("page_tables needs one row per sequence and a positive page_size")
    return KernelSequences(cu_q, cu_k, page_tables, page_size, causal)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sequences: KernelSequences,
    *,
    scale: float | None = None,
    bf16_kernel: str = DEFAULT_BF16_KERNEL,
    keys_packed: bool = False,
    new_kv: NewKV | None = None,
) -> torch.Tensor:
    """Attention of the packed queries q [q_tokens, heads, dim] over k and v: [k_tokens,
    kv_heads, dim] token streams, or [slots, kv_heads, dim] caches when `sequences` has page
    tables. When causal, each sequence's queries are its last tokens: query i of n_q sees keys
    0..n_k-n_q+i. Keys and values are in q's dtype, or bf16 under float32 queries (a cache
    kept in bf16). bf16_kernel: which implementation runs bf16 (BF16_KERNELS). keys_packed:
    k is a bf16 cache's keys in the packed layout (vacpack/kvcache/paged_cache.py). new_kv: a
    step's keys and values, stored into the cache (k and v, with page tables) first. Returns
    q's shape."""
    out, _ = _attention(q, k, v, sequences, scale, bf16_kernel, keys_packed, new_kv, with_lse=False)
    return out


def attend_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sequences: KernelSequences,
    *,
    scale: float | None = None,
    bf16_kernel: str = DEFAULT_BF16_KERNEL,
    keys_packed: bool = False,
    new_kv: NewKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attend, and each row's float32 log-sum-exp of its scaled scores ([q_tokens, heads]),
    to merge with attention over other keys (cascade.merge_by_lse)."""
    out, lse = _attention(
        q, k, v, sequences, scale, bf16_kernel, keys_packed, new_kv, with_lse=True
    )
    assert lse is not None
    return out, lse


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """attend over packed sequences, in one call (see packed_sequences)."""
    sequences = packed_sequences(cu_seqlens_q, cu_seqlens_k, causal=causal)
    return attend(q, k, v, sequences, scale=scale)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    page_tables: torch.Tensor,
    page_size: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    bf16_kernel: str = DEFAULT_BF16_KERNEL,
    keys_packed: bool = False,
) -> torch.Tensor:
    """attend over a paged KV cache, in one call (see paged_sequences). One call covers
    decodes, fresh prefills and prefill chunks over cached pages alike."""
    sequences = paged_sequences(cu_seqlens_q, context_lens, page_tables, page_size, causal=causal)
    caches = (key_cache, value_cache)
    out, _ = _attention(
        q, *caches, sequences, scale, bf16_kernel, keys_packed, None, with_lse=False
    )
    return out


def paged_attention_with_lse(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    page_tables: torch.Tensor,
    page_size: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    bf16_kernel: str = DEFAULT_BF16_KERNEL,
    keys_packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention and each row's log-sum-exp (see attend_with_lse)."""
    sequences = paged_sequences(cu_seqlens_q, context_lens, page_tables, page_size, causal=causal)
    caches = (key_cache, value_cache)
    out, lse = _attention(
        q, *caches, sequences, scale, bf16_kernel, keys_packed, None, with_lse=True
    )
    assert lse is not None
    return out, lse


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sequences: KernelSequences,
    scale: float | None,
    bf16_kernel: str,
    keys_packed: bool,
    new_kv: NewKV | None,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    kernel = _kernel(q.dtype, bf16_kernel)
    supported = varlen_attention_supported(q.device, q.dtype, q.shape[-1], bf16_kernel)
    if kernel is None or not supported:
        raise RuntimeError(
            "the CPU attention kernel needs bf16 or float32 CPU tensors, a head size it takes "
            "and its library"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = v.shape[1]
    if v.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"mismatched shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    check_cache_dtype(q.dtype, k.dtype, v.dtype)
    page_tables = sequences.page_tables
    if keys_packed:
        _check_packed_keys(q, k, v, sequences)
    elif k.shape[1:] != v.shape[1:]:
        raise ValueError(f"mismatched shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    new_arguments: tuple[object, ...] = NO_NEW_KV
    if new_kv is not None:  # checked on the cache itself, before any copy below
        page_size = sequences.page_size if page_tables is not None else None
        new_keys, new_values, new_slots, num_slots = stored_rows(
            new_kv, k, v, page_size, keys_packed
        )
        new_arguments = (
            new_keys.data_ptr(), new_values.data_ptr(), new_slots.data_ptr(), new_slots.numel(),
            new_keys.stride(0), new_values.stride(0), num_slots,
        )  # fmt: skip
    if not keys_packed:
        k = rows_of_heads(k)
    q, v = rows_of_heads(q), rows_of_heads(v)
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if with_lse else None
    with profiler_range(PROFILER_NAME):
        status = kernel(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            sequences.cu_seqlens_q.data_ptr(),
            sequences.cu_seqlens_k.data_ptr(),
            sequences.num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            out.stride(0),
            None if page_tables is None else page_tables.data_ptr(),
            0 if page_tables is None else page_tables.stride(0),
            sequences.page_size,
            int(keys_packed),
            None if lse is None else lse.data_ptr(),
            head_dim**-0.5 if scale is None else scale,
            int(sequences.causal),
            int(k.dtype == torch.bfloat16),
            torch.get_num_threads(),
            *new_arguments,
        )
    if status == NEW_SLOT_OUTSIDE_CACHE:
        raise ValueError("a new key's slot lies outside the KV cache; nothing was stored")
    if status != 0:
        raise MemoryError("the CPU attention kernel could not allocate its per-thread buffers")
    return out, lse


def _check_packed_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequences: KernelSequences
) -> None:
    """Packed keys are a bf16 paged cache's, contiguous, in the shape of its pages and heads."""
    bf16 = q.dtype == k.dtype == torch.bfloat16
    if not bf16 or sequences.page_tables is None:
        raise ValueError(
            "packed keys are read by the bf16 kernels from a bf16 paged cache, "
            f"not under {q.dtype} queries over {k.dtype} keys"
            + ("" if sequences.page_tables is not None else " without page tables")
        )
    num_pages, num_kv_heads, head_dim = k.shape[0], v.shape[1], v.shape[2]
    expected = packed_key_shape(num_pages, sequences.page_size, num_kv_heads, head_dim)
    if k.shape != expected or not k.is_contiguous():
        raise ValueError(
            f"packed keys of shape {tuple(k.shape)} are not those of pages of "
            f"{sequences.page_size} slots, {num_kv_heads} KV heads of {head_dim}"
        )
