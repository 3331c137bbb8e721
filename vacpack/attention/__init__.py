from vacpack.attention.backend import AttentionBackend, BatchLayout, DecodeGraphBuffers
from vacpack.attention.registry import (
    Phase,
    auto_candidates,
    create_backend,
    eligible_backends,
    resolve_backend_name,
)
from vacpack.attention.selection import SelectedBackend, select_backend
from vacpack.attention.timed_steps import (
    AttentionShapes,
    DecodeBatchShape,
    PackedBinShape,
    PagedPrefillShape,
)

__all__ = [
    "AttentionBackend",
    "AttentionShapes",
    "BatchLayout",
    "DecodeBatchShape",
    "DecodeGraphBuffers",
    "PackedBinShape",
    "PagedPrefillShape",
    "Phase",
    "SelectedBackend",
    "auto_candidates",
    "create_backend",
    "eligible_backends",
    "resolve_backend_name",
    "select_backend",
]
