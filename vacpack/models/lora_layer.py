"""LoRA on the linear layers: y = x W^T + (x A^T) B^T for each row's adapter.

Every adapted linear holds a `LinearLora`: per adapter id, A [rank, in_features] and B
[out_features, rank], the adapter's scaling folded into B. For a merged layer (query, key and
value in one matmul) the parts' A matrices are stacked and B is block-diagonal, so one pair of
small matmuls serves all parts. The rows of a step go by adapter: `LoraState.batch` (shared by
all of a model's linears, set for the step's forward) lists each adapter's rows; rows of the
base model alone take no extra work, and a step without adapters costs one attribute check per
layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoraRows:
    """The rows of a step's packed stream that run adapter `lora_id`: `rows` ([n] int64 on
    the device), or None for every row."""

    lora_id: int
    rows: torch.Tensor | None


@dataclass
class LoraState:
    """The adapters' rows for the forward being run; None between forwards and for steps that
    run the base model alone."""

    batch: list[LoraRows] | None = None
    num_rows: int = 0  # the step's rows, which every adapted layer sees in full


@dataclass
class LinearLora:
    """One linear layer's adapters, by adapter id."""

    state: LoraState
    weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state.batch is not None

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter delta (y is updated in place and returned)."""
        assert self.state.batch is not None
        if x.shape[0] != self.state.num_rows:
            raise RuntimeError(
                f"a LoRA layer got {x.shape[0]} rows of a {self.state.num_rows}-row step: "
                "adapters apply to layers that see every row of the step"
            )
        for group in self.state.batch:
            pair = self.weights.get(group.lora_id)
            if pair is None:  # the adapter leaves this layer as it is
                continue
            a, b = pair
            if a.dtype != x.dtype:  # kept in the activations' dtype after the first use
                a, b = a.to(x.dtype), b.to(x.dtype)
                self.weights[group.lora_id] = (a, b)
            if group.rows is None:
                y.addmm_(torch.mm(x, a.t()), b.t())  # the add fused into the second product
            else:
                rows = x.index_select(0, group.rows)
                y.index_add_(0, group.rows, torch.mm(torch.mm(rows, a.t()), b.t()))
        return y
