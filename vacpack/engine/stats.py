"""Running totals of what the engine did since it started (the step records are in the
timeline, which a benchmark may reset; these only grow, as Prometheus counters must)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_steps: int = 0
    num_processed_tokens: int = 0  # prompt and output tokens computed by the model
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    def record_step(self, num_tokens: int, num_generated_tokens: int, num_preemptions: int) -> None:
        self.num_steps += 1
        self.num_processed_tokens += num_tokens
        self.num_generated_tokens += num_generated_tokens
        self.num_preemptions += num_preemptions
