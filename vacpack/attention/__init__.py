# Imported for their registration: the portable backend and the CPU kernels' one.
from vacpack.attention import cpu_kernel_backend, torch_sdpa  # noqa: F401
from vacpack.attention.backend import (
    AttentionBackend,
    BatchLayout,
    DecodeGraphBuffers,
    create_backend,
    register_backend,
)
from vacpack.attention.selection import select_backend


def _triton_backend() -> AttentionBackend:
    # Imported when first asked for: importing triton takes a while, and a CPU test must set
    # TRITON_INTERPRET before the kernels are defined.
    from vacpack.attention.triton_backend import TritonBackend

    return TritonBackend()


register_backend("triton", _triton_backend)

__all__ = [
    "AttentionBackend",
    "BatchLayout",
    "DecodeGraphBuffers",
    "create_backend",
    "select_backend",
]
