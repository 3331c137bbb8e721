from vacpack.kvcache.page_allocator import OutOfPagesError, PageAllocator
from vacpack.kvcache.paged_cache import KVLayer, PagedKVCache, kv_bytes_per_token

__all__ = ["KVLayer", "OutOfPagesError", "PageAllocator", "PagedKVCache", "kv_bytes_per_token"]
