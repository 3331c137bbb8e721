"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
from torch import nn

from vacpack.cpu_kernels.elementwise import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    # Set by the model once loaded on a bf16 CPU: one fused C pass per row instead of eight ops.
    use_cpu_kernels: bool = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def load_shard(self, name: str, tensor: torch.Tensor, shard_index: int = 0) -> None:
        self.weight.data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernels and x.dim() == 2 and x.stride(1) == 1:
            return rms_norm(x, self.weight, self.eps)
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_float.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the pre-norm block's two outputs. The
        sum may be written into `residual` in place (the block's residual stream is its own)."""
        if self.use_cpu_kernels and x.is_contiguous() and residual.is_contiguous():
            return add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual
