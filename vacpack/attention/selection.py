"""Which attention backend a device gets when the configuration says "auto"."""

from __future__ import annotations

import torch

from vacpack.attention.backend import AttentionBackend, create_backend


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The registered backend that "auto" means on this device; other names pass through."""
    if name != "auto":
        return name
    return "torch_sdpa"


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    return create_backend(resolve_backend_name(name, device))
