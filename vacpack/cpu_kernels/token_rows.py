"""Token streams as the C kernels take them: [tokens, heads, head_dim] with each token's heads
side by side in memory and any stride between tokens (a slice of a wider projection's output
passes without a copy)."""

from __future__ import annotations

import torch


def heads_side_by_side(x: torch.Tensor) -> bool:
    """Whether each token's heads of x [tokens, heads, head_dim] lie in one run."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x with each token's heads side by side: itself where they are, else a copy."""
    return x if heads_side_by_side(x) else x.contiguous()
