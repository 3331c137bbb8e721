"""Packed variable-length attention on bf16 CPUs, from varlen_attention.c.

PyTorch's CPU attention kernel runs at a fraction of the CPU's bf16 matmul speed on small
heads: with 32-dim heads (all-MiniLM-L6-v2) it is bound by its float32 exponentials and the
[queries, keys] matrices it writes, and with 64-dim grouped heads (Qwen2.5-0.5B) it measured
50-130 GFLOPS. The C kernel keeps a block of scores in registers and cache, uses the CPU's
bf16 dot-product instruction for both products and a polynomial exp2, and reads the packed
token stream directly: one call per batch, no padding, no gathers.
"""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import load_kernel_library

_LIBRARY_NAME = "varlen_attention"
# The value product works on 32 dims at a time.
HEAD_DIM_MULTIPLE = 32
MAX_HEAD_DIM = 256


def _kernel() -> ctypes._CFuncPtr | None:
    library = load_kernel_library(_LIBRARY_NAME)
    if library is None:
        return None
    function = library.varlen_attention_bf16
    if function.argtypes is None:
        function.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int64] * 8
            + [
                ctypes.c_float,
                ctypes.c_int,
                ctypes.c_int,
            ]
        )
        function.restype = ctypes.c_int
    return function


def varlen_attention_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether varlen_attention runs here for tensors of this device, dtype and head size."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and head_dim % HEAD_DIM_MULTIPLE == 0
        and head_dim <= MAX_HEAD_DIM
        and _kernel() is not None
    )


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x with each token's heads side by side in memory (any stride between tokens)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


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
    """Attention of packed sequences: q [q_tokens, heads, dim], k and v [k_tokens, kv_heads,
    dim], sequence b owning query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows
    cu_seqlens_k[b]:cu_seqlens_k[b+1]. When causal, each sequence's queries are its last
    tokens: query i of n_q sees keys 0..n_k-n_q+i. Returns q's shape."""
    kernel = _kernel()
    if kernel is None or not varlen_attention_supported(q.device, q.dtype, q.shape[-1]):
        raise RuntimeError("varlen_attention needs bf16 CPU tensors and the compiled kernel")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if k.shape[2] != head_dim or v.shape[1:] != k.shape[1:] or num_heads % num_kv_heads:
        raise ValueError(f"mismatched shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    cu_q = cu_seqlens_q.to(torch.int64).contiguous()
    cu_k = cu_seqlens_k.to(torch.int64).contiguous()
    num_seqs = cu_q.numel() - 1
    if cu_k.numel() != num_seqs + 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k describe different numbers of sequences")
    if causal and bool(((cu_k.diff() - cu_q.diff()) < 0).any()):
        raise ValueError("causal attention needs at least as many keys as queries per sequence")
    q, k, v = _rows_of_heads(q), _rows_of_heads(k), _rows_of_heads(v)
    out = torch.empty(q.shape, dtype=q.dtype)
    status = kernel(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        cu_q.data_ptr(),
        cu_k.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        head_dim**-0.5 if scale is None else scale,
        int(causal),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("varlen_attention could not allocate its per-thread buffers")
    return out
