"""Attention on CPUs in one C call per batch: packed variable-length sequences, and queries
over a paged KV cache (with log-sum-exp, for cascades). bf16 from varlen_attention.c (x86 with
AVX512-BF16), float32 from varlen_attention_f32.c (plain C vectorised for the CPU at hand: any
CPU with a C compiler).

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.cache_dtype import check_cache_dtype

# Per dtype: the library, whether it is portable (built for any CPU), its function, and the
# multiple of head_dim it takes (the bf16 value product works on 32 dims at a time, the float32
# kernel on 8-lane vectors).
_LIBRARIES: dict[torch.dtype, tuple[str, bool, str, int]] = {
    torch.bfloat16: ("varlen_attention", False, "varlen_attention_bf16", 32),
    torch.float32: ("varlen_attention_f32", True, "varlen_attention_f32", 8),
}
MAX_HEAD_DIM = 256
PROFILER_NAME = "vacpack::varlen_attention"


_ARGTYPES = [
    *[ctypes.c_void_p] * 6,  # q, k, v, out, cu_q, cu_k
    *[ctypes.c_int64] * 8,  # sequences, heads, KV heads, head dim, four row strides
    ctypes.c_void_p,  # page tables, or None
    *[ctypes.c_int64] * 2,  # page table row stride, page size
    ctypes.c_void_p,  # log-sum-exp out, or None
    ctypes.c_float,  # scale
    ctypes.c_int,  # causal
    ctypes.c_int,  # keys and values bf16 (else float32)
    ctypes.c_int,  # threads
]


def _kernel(dtype: torch.dtype) -> KernelFunction | None:
    if dtype not in _LIBRARIES:
        return None
    library, portable, function, _ = _LIBRARIES[dtype]
    return kernel_function(library, function, _ARGTYPES, ctypes.c_int, portable=portable)


def head_dim_multiple(dtype: torch.dtype) -> int:
    """The kernel of `dtype` takes head sizes that are a multiple of this (0: no kernel)."""
    return _LIBRARIES[dtype][3] if dtype in _LIBRARIES else 0


def varlen_attention_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether varlen_attention runs here for tensors of this device, dtype and head size."""
    multiple = head_dim_multiple(dtype)
    return (
        device.type == "cpu"
        and multiple > 0
        and head_dim % multiple == 0
        and head_dim <= MAX_HEAD_DIM
        and _kernel(dtype) is not None
    )


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x with each token's heads side by side in memory (any stride between tokens)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


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
) -> torch.Tensor:
    """Attention of the packed queries q [q_tokens, heads, dim] over k and v: [k_tokens,
    kv_heads, dim] token streams, or [slots, kv_heads, dim] caches when `sequences` has page
    tables. When causal, each sequence's queries are its last tokens: query i of n_q sees keys
    0..n_k-n_q+i. Keys and values are in q's dtype, or bf16 under float32 queries (a cache
    kept in bf16). Returns q's shape."""
    out, _ = _attention(q, k, v, sequences, scale, with_lse=False)
    return out


def attend_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sequences: KernelSequences,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attend, and each row's float32 log-sum-exp of its scaled scores ([q_tokens, heads]),
    to merge with attention over other keys (cascade.merge_by_lse)."""
    out, lse = _attention(q, k, v, sequences, scale, with_lse=True)
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
) -> torch.Tensor:
    """attend over a paged KV cache, in one call (see paged_sequences). One call covers
    decodes, fresh prefills and prefill chunks over cached pages alike."""
    sequences = paged_sequences(cu_seqlens_q, context_lens, page_tables, page_size, causal=causal)
    return attend(q, key_cache, value_cache, sequences, scale=scale)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention and each row's log-sum-exp (see attend_with_lse)."""
    sequences = paged_sequences(cu_seqlens_q, context_lens, page_tables, page_size, causal=causal)
    return attend_with_lse(q, key_cache, value_cache, sequences, scale=scale)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sequences: KernelSequences,
    scale: float | None,
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    kernel = _kernel(q.dtype)
    if kernel is None or not varlen_attention_supported(q.device, q.dtype, q.shape[-1]):
        raise RuntimeError(
            "the CPU attention kernel needs bf16 or float32 CPU tensors, a head size it takes "
            "and its library"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if k.shape[2] != head_dim or v.shape[1:] != k.shape[1:] or num_heads % num_kv_heads:
        raise ValueError(f"mismatched shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    check_cache_dtype(q.dtype, k.dtype, v.dtype)
    page_tables = sequences.page_tables
    q, k, v = _rows_of_heads(q), _rows_of_heads(k), _rows_of_heads(v)
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if with_lse else None
    # Named for torch.profiler, which cannot see into a ctypes call otherwise.
    with torch.profiler.record_function(PROFILER_NAME):
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
            None if lse is None else lse.data_ptr(),
            head_dim**-0.5 if scale is None else scale,
            int(sequences.causal),
            int(k.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
    if status != 0:
        raise MemoryError("the CPU attention kernel could not allocate its per-thread buffers")
    return out, lse
