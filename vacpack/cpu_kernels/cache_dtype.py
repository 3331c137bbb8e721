"""Which KV cache dtypes attention reads under which queries' dtype: the contract of the C
kernels here, which every other attention path keeps too (vacpack/attention)."""

from __future__ import annotations

import torch


def cache_dtype_readable(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether attention in `query_dtype` reads a cache of `cache_dtype`: its own dtype, or
    bfloat16 under float32 (a model computing in float32 whose cache is kept in bfloat16: half
    the memory and half the bytes a decode reads, each value widened as it is read)."""
    return cache_dtype == query_dtype or (
        query_dtype == torch.float32 and cache_dtype == torch.bfloat16
    )


def check_cache_dtype(
    query_dtype: torch.dtype, keys_dtype: torch.dtype, values_dtype: torch.dtype
) -> None:
    if keys_dtype != values_dtype or not cache_dtype_readable(query_dtype, keys_dtype):
        raise ValueError(
            f"the KV cache (keys {keys_dtype}, values {values_dtype}) must be in the queries' "
            f"dtype ({query_dtype}), or bfloat16 under float32 queries"
        )
