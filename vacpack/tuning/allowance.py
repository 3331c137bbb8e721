"""The time a model's first load may spend measuring, shared by all of its choices.

Each phase asks for its own timing budget (a linear shape 0.25 s, the decode attention form
0.25 s, ...), sized for what it decides. Alone those budgets bound the rounds, not the whole:
building candidates (packing a weight twice, filling a KV cache) is spent before the rounds,
and a model with many shapes asks for many budgets. An allowance is the ledger of one load:
every measurement under it is charged to it, and a phase is granted no more than what is left,
so a first load spends about `total_s` timing (once it is spent, a phase times one round of
its candidates after their warm-up, and picks by that). Loads whose choices are cached spend
nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# The bound on timing at a first load, for all of a model's phases together.
FIRST_LOAD_TIMING_S = 2.0


class TimingAllowance:
    """Seconds of measurement left to a load; charged by `vacpack.tuning.choose`."""

    def __init__(self, total_s: float = FIRST_LOAD_TIMING_S) -> None:
        if total_s < 0:
            raise ValueError(f"a timing allowance cannot be negative, got {total_s} s")
        self.total_s = total_s
        self.spent_s = 0.0

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.total_s - self.spent_s)

    def grant(self, requested_s: float) -> float:
        """The timing budget a phase that asked for `requested_s` may use."""
        return min(requested_s, self.remaining_s)

    def charge(self, seconds: float) -> None:
        self.spent_s += max(0.0, seconds)


_current: contextvars.ContextVar[TimingAllowance | None] = contextvars.ContextVar(
    "timing_allowance", default=None
)


def current_allowance() -> TimingAllowance | None:
    """The allowance measurements are charged to here, or None (budgets alone bound them)."""
    return _current.get()


@contextlib.contextmanager
def spending(allowance: TimingAllowance) -> Iterator[TimingAllowance]:
    """Charges the measurements made inside the block to `allowance`."""
    token = _current.set(allowance)
    try:
        yield allowance
    finally:
        _current.reset(token)
