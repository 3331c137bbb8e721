"""Hand-written CPU kernels (C, AVX-512 BF16) for what PyTorch's CPU kernels do slowly."""

from vacpack.cpu_kernels.attention import (
    KernelSequences,
    attend,
    attend_with_lse,
    packed_sequences,
    paged_attention,
    paged_attention_with_lse,
    paged_sequences,
    varlen_attention,
    varlen_attention_supported,
)

__all__ = [
    "KernelSequences",
    "attend",
    "attend_with_lse",
    "packed_sequences",
    "paged_attention",
    "paged_attention_with_lse",
    "paged_sequences",
    "varlen_attention",
    "varlen_attention_supported",
]
