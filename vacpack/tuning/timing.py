"""Timing candidate implementations of one phase against each other on a noisy, shared machine.

Each candidate first runs once untimed (allocations, oneDNN primitive creation, a kernel's first
load). Then rounds call every candidate once, interleaved in a rotating order, so that a burst of
other work on the machine slows all candidates alike rather than whichever ran during it; a
candidate's time is its best over the rounds, since on a shared machine noise only ever adds
time. Rounds run while the next one fits in the time budget, up to a cap, after the `min_rounds`
that run regardless (choose.py asks for one: warm-up times carry first calls' costs). On a GPU
each call is timed from an idle device to the end of the work it queued.

Best-of rounds outvote a slowed call only when there are rounds to outvote it with. A stall of
the whole machine (the process descheduled, its pages swapped in, the virtual machine's cores
taken away) can last through a short measurement's rounds and decide it: at one load on the
2-core Zen 4 a stall slowed both candidates of the bf16 arithmetic choice 70-200x, bf16 the
more, and that process ran its linears in float32 at half speed. So on a CPU each call also
reads the calling thread's CPU time. A CPU candidate keeps that thread busy, computing or
spinning at the end of its parallel region while the other threads finish, so a call during
which it ran for less than MIN_THREAD_SHARE of the wall time was stalled. A stalled call is no
sample, its round does not count towards settling the choice, and its time is not charged to
the budget (up to STALL_GRACE_S, and never more than the budget itself), so the rounds go on
past a short stall instead of ending in it. (The process's CPU time would also see a thread
other than the caller held back, but Linux folds other threads' time into it at scheduler ticks,
4 ms apart: sub-millisecond calls read 1 or 16 cores.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Clock = Callable[[], float]

DEFAULT_MAX_ROUNDS = 7
# Timed rounds after which a choice is settled: a burst of other work that slowed the fastest
# candidate in one or two rounds is outvoted by its best of three. A choice on fewer rounds
# (its budget or the load's timing allowance ran out) is timed again at the next load (see
# choose.py).
SETTLED_ROUNDS = 3

# A call during which the calling thread ran for less than this share of the wall time was
# stalled: clean calls read 0.99-1.0 on the 2-core Zen 4, calls beside four busy processes
# 0.24-0.43.
MIN_THREAD_SHARE = 0.5
# Wall time a measurement may spend past its budget waiting out stalls: bounded, since a stall
# may outlast any measurement (then its times stand, and the choice stays unsettled).
STALL_GRACE_S = 0.5


@dataclass(frozen=True)
class Timings:
    best_time_s: dict[str, float]  # candidates that ran, fastest call each
    failed: dict[str, str]  # candidates that raised: the error
    num_rounds: int  # timed rounds with no stalled call (0: stalled calls' or warm-up times)
    elapsed_s: float
    num_stalled_calls: int = 0  # timed calls left out as stalled


@dataclass(frozen=True)
class _Call:
    wall_s: float
    cpu_s: float | None  # the calling thread's CPU time over the call, where it is read

    @property
    def stalled(self) -> bool:
        return self.cpu_s is not None and self.cpu_s < MIN_THREAD_SHARE * self.wall_s


def time_candidates(
    candidates: Mapping[str, Callable[[], object]],
    *,
    budget_s: float,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    min_rounds: int = 0,
    enough_rounds: int = SETTLED_ROUNDS,
    clock: Clock = time.perf_counter,
    cpu_clock: Clock | Literal["auto"] | None = "auto",
) -> Timings:
    """Times `candidates` within `budget_s`; the first `min_rounds` rounds run whatever the
    budget says. After `enough_rounds`, rounds stop as soon as they all agree. `cpu_clock`
    reads the calling thread's CPU time, to tell stalled calls; "auto": time.thread_time where
    `clock` is the real one and no GPU is in use (a GPU call leaves the CPU idle)."""
    cpu = _resolve_cpu_clock(cpu_clock, clock)
    grace_s = min(STALL_GRACE_S, budget_s)
    start_s = clock()
    failed: dict[str, str] = {}
    warmup_s: dict[str, float] = {}
    for name, candidate in candidates.items():
        outcome = _timed_call(candidate, clock, cpu)
        if isinstance(outcome, str):
            failed[name] = outcome
        else:
            warmup_s[name] = outcome.wall_s
    running = [name for name in candidates if name in warmup_s]
    calls: dict[str, list[_Call]] = {name: [] for name in running}
    num_rounds = num_stalled_rounds = 0
    stalled_s = 0.0
    estimated_round_s = sum(warmup_s.values())
    while running and num_rounds < max_rounds:
        spent_s = clock() - start_s - min(stalled_s, grace_s)
        if num_rounds + num_stalled_rounds >= min_rounds and spent_s + estimated_round_s > budget_s:
            break
        round_start_s = clock()
        shift = (num_rounds + num_stalled_rounds) % len(running)
        round_stalled_s = 0.0
        for name in running[shift:] + running[:shift]:
            outcome = _timed_call(candidates[name], clock, cpu)
            if isinstance(outcome, str):
                failed[name] = outcome
                continue
            calls[name].append(outcome)
            if outcome.stalled:
                round_stalled_s += outcome.wall_s
        running = [name for name in running if name not in failed]
        if round_stalled_s:
            num_stalled_rounds += 1
            stalled_s += round_stalled_s
        else:
            num_rounds += 1
        clean = {name: _clean_times(calls[name]) for name in running}
        # The next round costs about what this one did; after a stall, what the clean calls
        # did (a candidate with none yet: its warm-up).
        estimated_round_s = (
            sum(min(clean[name], default=warmup_s[name]) for name in running)
            if round_stalled_s
            else clock() - round_start_s
        )
        if num_rounds >= enough_rounds and _rounds_agree(list(clean.values())):
            break
    best_time_s = {}
    for name in running:
        times = _clean_times(calls[name]) or [call.wall_s for call in calls[name]]
        best_time_s[name] = min(times) if times else warmup_s[name]
    num_stalled_calls = sum(len(calls[name]) - len(_clean_times(calls[name])) for name in running)
    return Timings(best_time_s, failed, num_rounds, clock() - start_s, num_stalled_calls)


def _resolve_cpu_clock(cpu_clock: Clock | Literal["auto"] | None, clock: Clock) -> Clock | None:
    if cpu_clock != "auto":
        return cpu_clock
    if clock is not time.perf_counter or (
        torch.cuda.is_available() and torch.cuda.is_initialized()
    ):
        return None
    return time.thread_time


def _clean_times(calls: list[_Call]) -> list[float]:
    return [call.wall_s for call in calls if not call.stalled]


def _rounds_agree(samples: list[list[float]]) -> bool:
    """Whether one candidate's slowest call beat every other candidate's fastest: more rounds
    would not change the choice, only spend time another phase could use. With one candidate
    left running (or none: every other one raised) there is nothing to compare; a candidate
    with no clean call yet has nothing to compare with."""
    if len(samples) < 2:
        return True
    if not all(samples):
        return False
    leader = min(range(len(samples)), key=lambda i: min(samples[i]))
    return all(max(samples[leader]) < min(other) for i, other in enumerate(samples) if i != leader)


def _timed_call(candidate: Callable[[], object], clock: Clock, cpu: Clock | None) -> _Call | str:
    """One call's wall time (and the process's CPU time over it), or the error it raised (a
    candidate that raises is dropped)."""
    _wait_for_gpu()
    start_s = clock()
    start_cpu_s = cpu() if cpu is not None else 0.0
    try:
        candidate()
        _wait_for_gpu()
    except Exception as error:  # any failure only rules this candidate out
        return f"{type(error).__name__}: {error}"
    wall_s = clock() - start_s
    return _Call(wall_s, cpu() - start_cpu_s if cpu is not None else None)


def _wait_for_gpu() -> None:
    """Waits for the GPU work queued so far. A CUDA call returns once its kernels are queued:
    without this a candidate's time would be what launching it costs the host, and the work
    left queued by one candidate would be charged to the next."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
