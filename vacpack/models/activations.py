"""Activation functions by transformers' names (a config's `hidden_act`), and the ones oneDNN
applies to a matmul's output as it writes it (cpu_prepack.packed_linear)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType

import torch
import torch.nn.functional as F

# "gelu" is the exact (erf) GELU that BERT was trained with.
ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType(
    {
        "gelu": F.gelu,
        "gelu_new": partial(F.gelu, approximate="tanh"),
        "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
        "relu": F.relu,
        "silu": F.silu,
    }
)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated MLP's activation(gate) * up from its [gate | up] product, in PyTorch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


# (oneDNN's eltwise post-op, its algorithm) for the activations it fuses into a linear layer.
ONEDNN_POST_OPS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "gelu": ("gelu", "none"),
        "gelu_new": ("gelu", "tanh"),
        "gelu_pytorch_tanh": ("gelu", "tanh"),
        "relu": ("relu", ""),
    }
)
