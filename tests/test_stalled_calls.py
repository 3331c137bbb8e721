"""A stall of the whole machine during a measurement (vacpack/tuning/timing.py): calls during
which the calling thread got too little CPU time are no samples, do not settle a choice and
are not charged to the budget, up to a bounded grace. Fake clocks inject the stalls exactly;
one test stalls a real call."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_clock import FakeClock, Stall

from vacpack.tuning import choose
from vacpack.tuning.timing import SETTLED_ROUNDS, STALL_GRACE_S, time_candidates

PHASE = "stalled_phase"


def timed(clock: FakeClock, candidates: dict, budget_s: float = 1.0, **kwargs):
    return time_candidates(
        candidates, budget_s=budget_s, clock=clock, cpu_clock=clock.cpu, **kwargs
    )


def test_a_stall_through_the_first_rounds_does_not_decide() -> None:
    """The failure this guards against: a stall slowing both candidates, the faster more, for
    the first rounds. Best of those rounds alone picks the slower candidate."""
    stalled_rounds = [Stall(0.022)] * 3
    clock = FakeClock()
    blind = time_candidates(
        {"bf16": clock.costing(0.001, *stalled_rounds, 0.001),
         "f32": clock.costing(0.002, *[Stall(0.008)] * 3, 0.002)},
        budget_s=1.0, clock=clock, cpu_clock=None,
    )  # fmt: skip
    assert min(blind.best_time_s, key=blind.best_time_s.__getitem__) == "f32"

    clock = FakeClock()
    timings = timed(
        clock,
        {"bf16": clock.costing(0.001, *stalled_rounds, 0.001),
         "f32": clock.costing(0.002, *[Stall(0.008)] * 3, 0.002)},
    )  # fmt: skip
    assert timings.best_time_s == pytest.approx({"bf16": 0.001, "f32": 0.002})
    assert timings.num_stalled_calls == 6
    assert timings.num_rounds == SETTLED_ROUNDS  # clean rounds only: they settle it


def test_a_stalled_call_is_no_sample_and_its_round_settles_nothing() -> None:
    clock = FakeClock()
    fast = clock.costing(0.001, 0.001, Stall(0.0001), 0.001)  # a stall can only add time...
    timings = timed(clock, {"fast": fast, "slow": clock.costing(0.003)}, max_rounds=3)
    # ... yet its reading is left out all the same: one clean round more makes up for it.
    assert timings.best_time_s == pytest.approx({"fast": 0.001, "slow": 0.003})
    assert timings.num_stalled_calls == 1 and timings.num_rounds == 3
    assert len(fast.calls) == 1 + 4  # warm-up, 3 clean rounds and the stalled one


def test_stalled_time_is_not_charged_to_the_budget_up_to_the_grace() -> None:
    clock = FakeClock()
    candidates = {"a": clock.costing(0.01, Stall(0.3), 0.01), "b": clock.costing(0.02)}
    timings = timed(clock, candidates, budget_s=0.3, max_rounds=20, enough_rounds=20)
    # A warm-up of 0.03 s and a stalled round of 0.32 (0.3 forgiven) leave 0.25 s of the
    # budget: 8 clean rounds of 0.03 s.
    assert timings.num_stalled_calls == 1
    assert timings.num_rounds == 8 and timings.elapsed_s == pytest.approx(0.35 + 8 * 0.03)


def test_a_stall_longer_than_the_grace_leaves_the_choice_unsettled(tmp_path: Path) -> None:
    clock = FakeClock()
    candidates = {"a": clock.costing(0.01, Stall(1.0)), "b": clock.costing(0.02, Stall(2.0))}
    choice = choose(
        PHASE, "n=1", list(candidates), lambda: candidates, budget_s=STALL_GRACE_S,
        cache_dir=tmp_path, clock=clock, cpu_clock=clock.cpu,
    )  # fmt: skip
    # No clean round: the stalled times stand (they still rank the candidates), and the next
    # load times it again.
    assert choice.num_rounds == 0 and not choice.settled
    assert choice.chosen == "a" and choice.stalled_calls == 2
    assert "2 stalled calls left out" in choice.summary()
    assert choice.to_dict()["stalled_calls"] == 2


def test_the_grace_is_never_more_than_the_budget() -> None:
    """A phase left no budget (its load's allowance spent) times its one round and stops,
    stall or not: a stalled machine does not stretch a load beyond twice its allowance."""
    clock = FakeClock()
    candidates = {"a": clock.costing(0.01, Stall(0.2), 0.01), "b": clock.costing(0.02)}
    timings = timed(clock, candidates, budget_s=0.0, min_rounds=1)
    assert timings.num_rounds == 0 and timings.num_stalled_calls == 1
    assert timings.elapsed_s == pytest.approx(0.03 + 0.22)


def test_a_fake_clock_alone_reads_no_cpu_time() -> None:
    """With an injected wall clock and no CPU clock ("auto"), nothing counts as stalled: the
    real thread's CPU time would be meaningless beside fake wall times."""
    clock = FakeClock()
    timings = time_candidates(
        {"a": clock.costing(0.01, Stall(0.5), 0.01), "b": clock.costing(0.02)},
        budget_s=2.0, clock=clock,
    )  # fmt: skip
    assert timings.num_stalled_calls == 0 and timings.best_time_s["a"] == pytest.approx(0.01)


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_real_call_whose_thread_sleeps_is_stalled() -> None:
    """Real clocks: a candidate whose thread sleeps through its first timed calls (as a
    descheduled one would) is left out for them, and timed by its clean calls."""
    calls = []

    def sometimes_held_back() -> None:
        calls.append(None)
        if 2 <= len(calls) <= 3:  # its first two timed calls
            time.sleep(0.05)
        busy(0.002)

    timings = time_candidates(
        {"held": sometimes_held_back, "steady": lambda: busy(0.004)},
        budget_s=1.0,
        enough_rounds=SETTLED_ROUNDS,
    )
    assert timings.num_stalled_calls >= 2  # more only if this machine stalled it too
    assert timings.num_rounds >= SETTLED_ROUNDS
    assert timings.best_time_s["held"] < 0.02 < 0.05
