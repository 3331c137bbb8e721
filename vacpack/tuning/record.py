"""What a measured choice chose, and the timings that chose it: for logs, job reports and
/metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vacpack.tuning.timing import SETTLED_ROUNDS


class ChoiceSource(str, Enum):
    MEASURED = "measured"  # timed now, on this machine
    CACHED = "cached"  # timed by an earlier load with the same key; nothing was run now
    FORCED_ARGUMENT = "forced_argument"  # the caller named the candidate
    FORCED_ENV = "forced_env"  # an environment variable named it
    ONLY_CANDIDATE = "only_candidate"  # one candidate: nothing to compare


@dataclass(frozen=True)
class MeasuredChoice:
    """One phase's choice among named candidates.

    `best_time_s` holds each candidate's best time of one call (empty when the choice was
    forced or there was one candidate); `failed` the candidates that raised, with the error;
    `num_rounds` the timed rounds behind it, this load's and earlier loads' together.
    """

    phase: str
    shape_key: str
    chosen: str
    source: ChoiceSource
    best_time_s: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    num_rounds: int = 0
    measure_s: float = 0.0  # time spent timing at this load (0 when cached or forced)
    stalled_calls: int = 0  # calls of this load's timing left out as stalled (timing.py)

    @property
    def settled(self) -> bool:
        """Whether the choice stands for good: forced, the only candidate, or timed over enough
        rounds that one slowed round cannot have decided it."""
        timed = self.source in (ChoiceSource.MEASURED, ChoiceSource.CACHED)
        return not timed or self.num_rounds >= SETTLED_ROUNDS

    def speed_ratio(self, slower: str, faster: str) -> float | None:
        """How many times longer `slower` took than `faster`, where both were timed."""
        if slower not in self.best_time_s or faster not in self.best_time_s:
            return None
        return self.best_time_s[slower] / self.best_time_s[faster]

    def summary(self) -> str:
        """One line: what was chosen, how, and each candidate's time."""
        timings = ", ".join(f"{name} {s * 1e3:.3g} ms" for name, s in self.best_time_s.items())
        failed = "".join(f"; {name} failed ({error})" for name, error in self.failed.items())
        rounds = f", {self.num_rounds} rounds" if timings else ""
        stalled = f", {self.stalled_calls} stalled calls left out" if self.stalled_calls else ""
        unsettled = "" if self.settled else ", timed again at the next load"
        return (
            f"{self.phase} [{self.shape_key}]: {self.chosen} ({self.source.value}{rounds}"
            + stalled
            + unsettled
            + (f"; {timings}" if timings else "")
            + f"){failed}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields, for a report file or a metrics endpoint."""
        return {
            "phase": self.phase,
            "shape_key": self.shape_key,
            "chosen": self.chosen,
            "source": self.source.value,
            "best_time_s": dict(self.best_time_s),
            "failed": dict(self.failed),
            "num_rounds": self.num_rounds,
            "settled": self.settled,
            "measure_s": self.measure_s,
            "stalled_calls": self.stalled_calls,
        }
