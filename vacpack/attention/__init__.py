from vacpack.attention.backend import AttentionBackend, BatchLayout, DecodeGraphBuffers
from vacpack.attention.registry import (
    Phase,
    create_backend,
    eligible_backends,
    resolve_backend_name,
    select_backend,
)

__all__ = [
    "AttentionBackend",
    "BatchLayout",
    "DecodeGraphBuffers",
    "Phase",
    "create_backend",
    "eligible_backends",
    "resolve_backend_name",
    "select_backend",
]
