"""A clock that moves only when a fake candidate runs: timings injected exactly, no sleeping."""

from __future__ import annotations

from collections.abc import Callable


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def costing(self, *costs_s: float) -> Callable[[], None]:
        """A candidate whose calls take these times in turn (the last one repeats)."""
        remaining = list(costs_s)
        calls: list[float] = []

        def run() -> None:
            cost_s = remaining.pop(0) if len(remaining) > 1 else remaining[0]
            calls.append(cost_s)
            self.now_s += cost_s

        run.calls = calls  # type: ignore[attr-defined]
        return run
