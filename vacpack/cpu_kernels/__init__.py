"""Hand-written CPU kernels (C: portable, AVX-512 BF16, AMX) for what PyTorch's CPU kernels do
slowly."""

from vacpack.cpu_kernels.attention import (
    BF16_KERNELS,
    DEFAULT_BF16_KERNEL,
    KernelSequences,
    attend,
    attend_with_lse,
    packed_sequences,
    paged_attention,
    paged_attention_with_lse,
    paged_sequences,
    tile_kernel_ready,
    varlen_attention,
    varlen_attention_supported,
)
from vacpack.cpu_kernels.new_kv import NewKV

__all__ = [
    "BF16_KERNELS",
    "DEFAULT_BF16_KERNEL",
    "KernelSequences",
    "NewKV",
    "attend",
    "attend_with_lse",
    "packed_sequences",
    "paged_attention",
    "paged_attention_with_lse",
    "paged_sequences",
    "tile_kernel_ready",
    "varlen_attention",
    "varlen_attention_supported",
]
