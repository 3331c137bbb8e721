"""Which attention backend a device gets when the configuration says "auto"."""

from __future__ import annotations

import importlib.util

import torch

from vacpack.attention.backend import AttentionBackend, create_backend


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The registered backend that "auto" means on this device; other names pass through.

    CUDA with triton installed gets our Triton paged kernels; everything else the portable
    SDPA backend, which is also the reference the others are tested against.
    """
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch_sdpa"


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    return create_backend(resolve_backend_name(name, device))
