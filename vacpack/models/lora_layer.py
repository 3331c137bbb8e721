"""LoRA on the linear layers: y = x W^T + (x A^T) B^T for each row's adapter.

Every adapted linear holds a `LinearLora`: per adapter id, A [rank, in_features] and B
[out_features, rank], the adapter's scaling folded into B. For a merged layer (query, key and
value in one matmul) the parts' A matrices are stacked and B is block-diagonal, so one pair of
small matmuls serves all parts. The rows of a step go by adapter: `LoraState.batch` (shared by
all of a model's linears, set for the step's forward) lists each adapter's rows; rows of the
base model alone take no extra work, and a step without adapters costs one attribute check per
layer.

Several adapters in one step go one of two ways. Few rows (decodes): the adapters' A and B are
stacked into one pair, every row multiplies all of them and keeps only its own adapter's part
(a mask), three operations whatever the number of adapters, where each operation's fixed cost
outweighs its arithmetic. Many rows (prefill): each adapter takes its own rows (gather, two
matmuls, scatter-add), so no row pays for the others' ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Up to this many rows, a step's adapters run stacked (see above), until the engine has timed
# the crossing point on the model's shapes (vacpack/lora/stacking.py). Stacked, each row pays
# for every adapter's rank (four rank-16 adapters on Qwen2.5-0.5B's q/k/v add about a third of
# the layer's own product), worth it only while the per-operation cost dominates: at 16
# decode rows with four adapters stacking took the cost of LoRA from 28% to 17% on a 2-core
# Zen 3 (bench/lora_serving.py).
STACKED_MAX_ROWS = 64


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
    # [num_rows] int64 on the device: each row's adapter id (0: none), for stacked adapters.
    row_lora_ids: torch.Tensor | None = None
    stacked_max_rows: int = STACKED_MAX_ROWS  # up to this many rows, several adapters stack


@dataclass
class LinearLora:
    """One linear layer's adapters, by adapter id."""

    state: LoraState
    weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Stacked (A, B, each column's adapter id) by the adapters they stack; dropped whenever
    # `weights` changes.
    _stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    @property
    def active(self) -> bool:
        return self.state.batch is not None

    def set_weights(self, lora_id: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Adds (or with None removes) an adapter's (A, B)."""
        if pair is None:
            self.weights.pop(lora_id, None)
        else:
            self.weights[lora_id] = pair
        self._stacked.clear()

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter delta (y is updated in place and returned)."""
        state = self.state
        assert state.batch is not None
        if x.shape[0] != state.num_rows:
            raise RuntimeError(
                f"a LoRA layer got {x.shape[0]} rows of a {state.num_rows}-row step: "
                "adapters apply to layers that see every row of the step"
            )
        # The adapters that change this layer (an adapter may leave it as it is).
        groups = [group for group in state.batch if group.lora_id in self.weights]
        if len(groups) > 1 and x.shape[0] <= state.stacked_max_rows:
            assert state.row_lora_ids is not None
            a, b, column_ids = self._stacked_weights(tuple(g.lora_id for g in groups), x.dtype)
            hidden = torch.mm(x, a.t())
            hidden.mul_(state.row_lora_ids.unsqueeze(1) == column_ids)  # each row's own part
            return y.addmm_(hidden, b.t())
        for group in groups:
            a, b = self._weights_as(group.lora_id, x.dtype)
            if group.rows is None:
                y.addmm_(torch.mm(x, a.t()), b.t())  # the add fused into the second product
            else:
                rows = x.index_select(0, group.rows)
                y.index_add_(0, group.rows, torch.mm(torch.mm(rows, a.t()), b.t()))
        return y

    def _weights_as(self, lora_id: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapter's (A, B), kept in the activations' dtype after the first use."""
        a, b = self.weights[lora_id]
        if a.dtype != dtype:
            a, b = a.to(dtype), b.to(dtype)
            self.weights[lora_id] = (a, b)
        return a, b

    def _stacked_weights(
        self, lora_ids: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stacked = self._stacked.get(lora_ids)
        if stacked is None or stacked[0].dtype != dtype:
            pairs = [self._weights_as(lora_id, dtype) for lora_id in lora_ids]
            ranks = [a.shape[0] for a, _ in pairs]
            column_ids = torch.repeat_interleave(torch.tensor(lora_ids), torch.tensor(ranks))
            stacked = (
                torch.cat([a for a, _ in pairs]),
                torch.cat([b for _, b in pairs], dim=1),
                column_ids.to(pairs[0][0].device),
            )
            self._stacked[lora_ids] = stacked
        return stacked
