from vacpack.attention import torch_sdpa  # noqa: F401  (registers the portable backend)
from vacpack.attention.backend import AttentionBackend, BatchLayout, create_backend
from vacpack.attention.selection import select_backend

__all__ = ["AttentionBackend", "BatchLayout", "create_backend", "select_backend"]
