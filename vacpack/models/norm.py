"""RMSNorm and LayerNorm, computed by the layer ops the model was built with (see
layer_ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from vacpack.models.layer_ops import current_layer_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.ops = current_layer_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the pre-norm block's two outputs. The
        sum may be written into `residual` in place (the block's residual stream is its own)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class AddLayerNorm(nn.Module):
    """LayerNorm(x + residual): a post-norm (BERT) block's residual add and norm in one op; the
    parameters are nn.LayerNorm's (weight, bias), so checkpoints load into it unchanged."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.ops = current_layer_ops()

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
