"""Up to how many rows a step's several adapters run stacked (models/lora_layer.py), measured.

Stacked, every row multiplies all of the step's adapters and keeps its own part: three
operations however many adapters, but each row pays for every adapter's rank. Gathered, each
adapter takes its own rows: no wasted ranks, four operations per adapter. Which is faster at a
row count depends on the CPU or GPU, the layer's width and the adapters' ranks, so it is timed
once, on the model's widest adapted product (hidden size -> MLP width) with `max_loras`
adapters of `max_lora_rank`, through the layer's own code, at doubling row counts; the
threshold is the largest count up to which stacking won every time. Cached as every measured
choice is (vacpack/tuning); VACPACK_CHOICE_LORA_STACKED_ROWS=stacked or =gathered forces it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vacpack.models.lora_layer import LinearLora, LoraRows, LoraState
from vacpack.tuning.choose import choose
from vacpack.tuning.record import MeasuredChoice
from vacpack.tuning.timing import Clock

PHASE = "lora_stacked_rows"
CANDIDATES = ("stacked", "gathered")
ROW_COUNTS = (8, 16, 32, 64, 128, 256)
# For all row counts together: a small share of the first load's timing allowance.
BUDGET_S = 0.5


@dataclass(frozen=True)
class StackingShape:
    """The adapted product timed, and the adapters in a step."""

    in_features: int
    out_features: int
    num_adapters: int
    rank: int
    dtype: torch.dtype

    def key(self, num_rows: int) -> str:
        return (
            f"{num_rows} rows, {self.num_adapters} adapters of rank {self.rank}, "
            f"{self.in_features} -> {self.out_features}, {str(self.dtype).removeprefix('torch.')}"
        )


def choose_stacked_max_rows(
    shape: StackingShape, device: torch.device, *, clock: Clock = time.perf_counter
) -> tuple[int, tuple[MeasuredChoice, ...]]:
    """The most rows that run stacked (0: never), and the choices that set it."""
    if shape.num_adapters < 2:
        return 0, ()  # one adapter in a step never stacks
    choices: list[MeasuredChoice] = []
    stacked_max_rows = 0
    for num_rows in ROW_COUNTS:
        choice = choose(
            PHASE,
            shape.key(num_rows),
            CANDIDATES,
            functools.partial(_candidates, shape, num_rows, device),
            budget_s=BUDGET_S / len(ROW_COUNTS),
            clock=clock,
        )
        choices.append(choice)
        if choice.chosen != "stacked":
            break
        stacked_max_rows = num_rows
    return stacked_max_rows, tuple(choices)


def _candidates(
    shape: StackingShape, num_rows: int, device: torch.device
) -> dict[str, Callable[[], object]]:
    """Both forms of one layer's step: `num_rows` rows taking the adapters in turn, the same
    adapters, each form adding into its own outputs."""
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device, shape.dtype)

    lora_ids = list(range(1, shape.num_adapters + 1))
    row_lora_ids = torch.tensor([lora_ids[r % len(lora_ids)] for r in range(num_rows)])
    x = randn(num_rows, shape.in_features)
    y = randn(num_rows, shape.out_features)
    pairs = {
        lora_id: (randn(shape.rank, shape.in_features), randn(shape.out_features, shape.rank))
        for lora_id in lora_ids
    }

    def form(stacked_max_rows: int) -> Callable[[], object]:
        state = LoraState(
            batch=[
                LoraRows(lora_id, torch.nonzero(row_lora_ids == lora_id).flatten().to(device))
                for lora_id in lora_ids
            ],
            num_rows=num_rows,
            row_lora_ids=row_lora_ids.to(device),
            stacked_max_rows=stacked_max_rows,
        )
        layer = LinearLora(state)
        for lora_id, pair in pairs.items():
            layer.set_weights(lora_id, pair)
        return functools.partial(layer.add_to, x, y.clone())

    return {"stacked": form(num_rows), "gathered": form(0)}
