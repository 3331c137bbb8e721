from vacpack.kvcache.page_pool import OutOfPagesError, PagePool, PrefixCacheStats
from vacpack.kvcache.paged_cache import KVLayer, PagedKVCache, kv_bytes_per_token

__all__ = [
    "KVLayer",
    "OutOfPagesError",
    "PagePool",
    "PagedKVCache",
    "PrefixCacheStats",
    "kv_bytes_per_token",
]
