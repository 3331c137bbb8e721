"""A clock that moves only when a fake candidate runs: timings injected exactly, no sleeping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stall:
    """A call that took `wall_s` while its thread was held back: its CPU time stays put."""

    wall_s: float


class FakeClock:
    """The wall clock (call it) and the calling thread's CPU time (`cpu`), which a candidate's
    call advances alike unless the call is a Stall."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.cpu_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def cpu(self) -> float:
        return self.cpu_s

    def costing(self, *costs_s: float | Stall) -> Callable[[], None]:
        """A candidate whose calls take these times in turn (the last one repeats)."""
        remaining = list(costs_s)
        calls: list[float] = []

        def run() -> None:
            cost = remaining.pop(0) if len(remaining) > 1 else remaining[0]
            if isinstance(cost, Stall):
                calls.append(cost.wall_s)
                self.now_s += cost.wall_s
            else:
                calls.append(cost)
                self.now_s += cost
                self.cpu_s += cost

        run.calls = calls  # type: ignore[attr-defined]
        return run
