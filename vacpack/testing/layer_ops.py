"""Swapping a loaded model's elementwise-op implementations, for tests that compare a model
with its fused kernels against the same model without them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vacpack.models.layer_ops import LayerOps
from vacpack.models.llama import LlamaAttention

# Where each module keeps its ops: attention only rotates with them, the norms and MLPs run all.
_ATTRIBUTE_BY_MODULE: dict[type[torch.nn.Module], str] = {LlamaAttention: "rotary_ops"}


def layer_ops_holders(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, attribute) for every module of the model that holds a LayerOps."""
    holders = []
    for module in model.modules():
        attribute = _ATTRIBUTE_BY_MODULE.get(type(module), "ops")
        if isinstance(getattr(module, attribute, None), LayerOps):
            holders.append((module, attribute))
    return holders


def set_layer_ops(model: torch.nn.Module, make_ops: Callable[[int | None], LayerOps]) -> int:
    """Gives every holder make_ops(its rows per MLP pass); returns how many there were."""
    holders = layer_ops_holders(model)
    for module, attribute in holders:
        rows_per_pass = getattr(module, attribute).mlp_rows_per_pass
        setattr(module, attribute, make_ops(rows_per_pass))
    return len(holders)
