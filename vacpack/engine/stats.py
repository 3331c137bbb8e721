"""Per-step records and running totals of what the engine did."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    start_s: float
    end_s: float
    num_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_pages_used: int


@dataclass
class EngineStats:
    steps: list[StepRecord] = field(default_factory=list)
    num_generated_tokens: int = 0

    def record_step(self, **fields: float | int) -> None:
        self.steps.append(StepRecord(**fields))

    @property
    def num_processed_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preempted for s in self.steps)
