"""Which attention backend a device gets when the configuration says "auto"."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

import torch

from vacpack.attention.backend import AttentionBackend, AttentionSpec, create_backend
from vacpack.cpu_kernels import varlen_attention_supported

logger = logging.getLogger(__name__)

# Runs every kind of layer: what "auto" falls back to when its first choice cannot.
PORTABLE_BACKEND = "torch_sdpa"


def resolve_backend_name(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> str:
    """The registered backend that "auto" means for a model of this dtype and head size on this
    device; other names pass through.

    CUDA with triton installed gets our Triton paged kernels; a bf16 model on a CPU whose C
    kernels build here gets those; everything else the portable SDPA backend, which is also the
    reference the others are tested against.
    """
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    if (
        dtype is not None
        and head_dim is not None
        and varlen_attention_supported(device, dtype, head_dim)
    ):
        return "cpu_kernels"
    return "torch_sdpa"


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    specs: Sequence[AttentionSpec] = (),
) -> AttentionBackend:
    """The backend for a model whose layers attend as `specs` say (sliding windows, score
    scale and softcap). "auto" falls back to the portable backend when its first choice cannot
    run some layer; a backend named explicitly that cannot is an error."""
    backend = create_backend(resolve_backend_name(name, device, dtype, head_dim))
    reasons = {reason for spec in set(specs) if (reason := backend.unsupported(spec))}
    if not reasons:
        return backend
    if name == "auto":
        logger.info("attention: %s; using %s", "; ".join(sorted(reasons)), PORTABLE_BACKEND)
        return create_backend(PORTABLE_BACKEND)
    raise ValueError(
        f"attention backend {name!r} cannot run this model: {'; '.join(sorted(reasons))}. "
        f"Use attention_backend='auto' or '{PORTABLE_BACKEND}'"
    )
