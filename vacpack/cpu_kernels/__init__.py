"""Hand-written CPU kernels (C, AVX-512 BF16) for what PyTorch's CPU kernels do slowly."""

from vacpack.cpu_kernels.attention import (
    paged_attention,
    paged_attention_with_lse,
    varlen_attention,
    varlen_attention_supported,
)

__all__ = [
    "paged_attention",
    "paged_attention_with_lse",
    "varlen_attention",
    "varlen_attention_supported",
]
