"""Checking measured choices afterwards: each choice a load made (timed or read from the cache)
has its candidates rebuilt and timed again, over many more rounds than a load can afford, to
see how much slower the chosen one runs than the fastest. A choice within a few percent of the
fastest was a near tie; one far behind was decided by noise, or by timings that no longer hold
(`bench/choice_audit.py`).

    with recording() as recorded:
        llm = LLM(...)            # or anything else that makes choices
    for row in audit(recorded):
        print(row.choice.phase, row.chosen_over_fastest)
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vacpack.tuning.record import MeasuredChoice
from vacpack.tuning.timing import SETTLED_ROUNDS, Clock, time_candidates

AUDIT_ROUNDS = 15
# Per choice; the rounds stop at this, after at least SETTLED_ROUNDS.
AUDIT_BUDGET_S = 5.0

CandidateBuilder = Callable[[], Mapping[str, Callable[[], object]]]


@dataclass(frozen=True)
class RecordedChoice:
    choice: MeasuredChoice
    make_candidates: CandidateBuilder  # builds the candidates again, as the choice did


_recorded: contextvars.ContextVar[list[RecordedChoice] | None] = contextvars.ContextVar(
    "recorded_choices", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[RecordedChoice]]:
    """Collects every timed or cached choice made inside the block (forced ones and sole
    candidates have nothing to check), once per phase and shapes, in the order they came."""
    recorded: list[RecordedChoice] = []
    token = _recorded.set(recorded)
    try:
        yield recorded
    finally:
        _recorded.reset(token)


def remember(choice: MeasuredChoice, make_candidates: CandidateBuilder) -> None:
    """Called by `choose` for each timed or cached choice."""
    recorded = _recorded.get()
    if recorded is None:
        return
    key = (choice.phase, choice.shape_key)
    if all((r.choice.phase, r.choice.shape_key) != key for r in recorded):
        recorded.append(RecordedChoice(choice, make_candidates))


@dataclass(frozen=True)
class AuditedChoice:
    choice: MeasuredChoice  # what the load chose, and the timings it chose by
    best_time_s: dict[str, float]  # each candidate's best call in the audit
    failed: dict[str, str]  # candidates that raised in the audit
    num_rounds: int

    @property
    def fastest(self) -> str:
        return min(self.best_time_s, key=self.best_time_s.__getitem__)

    @property
    def chosen_over_fastest(self) -> float:
        """How many times longer the chosen candidate took than the fastest, in the audit
        (1.0: the choice was right; infinite: the chosen one failed)."""
        if self.choice.chosen not in self.best_time_s:
            return float("inf")
        return self.best_time_s[self.choice.chosen] / self.best_time_s[self.fastest]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields: the audit's timings, and what the load chose and on what."""
        choice = self.choice
        return {
            "phase": choice.phase,
            "shape_key": choice.shape_key,
            "chosen": choice.chosen,
            "source": choice.source.value,
            "load_rounds": choice.num_rounds,
            "settled": choice.settled,
            "load_best_time_s": dict(choice.best_time_s),
            "best_time_s": dict(self.best_time_s),
            "failed": dict(self.failed),
            "num_rounds": self.num_rounds,
            "fastest": self.fastest,
            "chosen_over_fastest": self.chosen_over_fastest,
        }


def audit(
    recorded: Sequence[RecordedChoice],
    *,
    rounds: int = AUDIT_ROUNDS,
    budget_s: float = AUDIT_BUDGET_S,
    clock: Clock = time.perf_counter,
) -> list[AuditedChoice]:
    """Each recorded choice's candidates, built again and timed over `rounds` interleaved
    rounds (at least SETTLED_ROUNDS, at most what `budget_s` allows beyond them), best of."""
    audited = []
    for entry in recorded:
        timings = time_candidates(
            entry.make_candidates(),
            budget_s=budget_s,
            max_rounds=rounds,
            min_rounds=min(rounds, SETTLED_ROUNDS),
            enough_rounds=rounds,  # no early stop: the audit wants every round
            clock=clock,
        )
        audited.append(
            AuditedChoice(entry.choice, timings.best_time_s, timings.failed, timings.num_rounds)
        )
    return audited
