"""Per-step records and running totals of what the engine did."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    start_s: float
    end_s: float
    num_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_pages_used: int


class EngineStats:
    """Running totals over every step, and the records of the most recent steps (a server
    runs forever, so the records are a ring)."""

    def __init__(self, max_records: int = 100_000) -> None:
        self._records: deque[StepRecord] = deque(maxlen=max_records)
        self.num_steps = 0
        self.num_processed_tokens = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0

    def record_step(self, **fields: float | int) -> None:
        record = StepRecord(**fields)
        self._records.append(record)
        self.num_steps += 1
        self.num_processed_tokens += record.num_tokens
        self.num_preemptions += record.num_preempted

    @property
    def steps(self) -> list[StepRecord]:
        """The kept records, oldest first."""
        return list(self._records)
