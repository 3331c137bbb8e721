"""Timing candidate implementations of one phase against each other on a noisy, shared machine.

Each candidate first runs once untimed (allocations, oneDNN primitive creation, a kernel's first
load). Then rounds call every candidate once, interleaved in a rotating order, so that a burst of
other work on the machine slows all candidates alike rather than whichever ran during it; a
candidate's time is its best over the rounds, since on a shared machine noise only ever adds
time. Rounds run while the next one fits in the time budget, up to a cap, after the `min_rounds`
that run regardless (choose.py asks for one: warm-up times carry first calls' costs). On a GPU
each call is timed from an idle device to the end of the work it queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Clock = Callable[[], float]

DEFAULT_MAX_ROUNDS = 7
# Timed rounds after which a choice is settled: a burst of other work that slowed the fastest
# candidate in one or two rounds is outvoted by its best of three. A choice on fewer rounds
# (its budget or the load's timing allowance ran out) is timed again at the next load (see
# choose.py).
SETTLED_ROUNDS = 3


@dataclass(frozen=True)
class Timings:
    best_time_s: dict[str, float]  # candidates that ran, fastest call each
    failed: dict[str, str]  # candidates that raised: the error
    num_rounds: int  # timed rounds (0: the warm-up times stand)
    elapsed_s: float


def time_candidates(
    candidates: Mapping[str, Callable[[], object]],
    *,
    budget_s: float,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    min_rounds: int = 0,
    enough_rounds: int = SETTLED_ROUNDS,
    clock: Clock = time.perf_counter,
) -> Timings:
    """Times `candidates` within `budget_s`; the first `min_rounds` rounds run whatever the
    budget says. After `enough_rounds`, rounds stop as soon as they all agree."""
    start_s = clock()
    failed: dict[str, str] = {}
    warmup_s: dict[str, float] = {}
    for name, candidate in candidates.items():
        outcome = _timed_call(candidate, clock)
        if isinstance(outcome, str):
            failed[name] = outcome
        else:
            warmup_s[name] = outcome
    running = [name for name in candidates if name in warmup_s]
    samples: dict[str, list[float]] = {name: [] for name in running}
    num_rounds = 0
    estimated_round_s = sum(warmup_s.values())
    while running and num_rounds < max_rounds:
        if num_rounds >= min_rounds and clock() - start_s + estimated_round_s > budget_s:
            break
        round_start_s = clock()
        shift = num_rounds % len(running)
        for name in running[shift:] + running[:shift]:
            outcome = _timed_call(candidates[name], clock)
            if isinstance(outcome, str):
                failed[name] = outcome
            else:
                samples[name].append(outcome)
        running = [name for name in running if name not in failed]
        num_rounds += 1
        estimated_round_s = clock() - round_start_s
        if num_rounds >= enough_rounds and _rounds_agree([samples[name] for name in running]):
            break
    best_time_s = {
        name: min(samples[name]) if samples[name] else warmup_s[name] for name in running
    }
    return Timings(best_time_s, failed, num_rounds, clock() - start_s)


def _rounds_agree(samples: list[list[float]]) -> bool:
    """Whether one candidate's slowest call beat every other candidate's fastest: more rounds
    would not change the choice, only spend time another phase could use. With one candidate
    left running (or none: every other one raised) there is nothing to compare."""
    if len(samples) < 2:
        return True
    leader = min(range(len(samples)), key=lambda i: min(samples[i]))
    return all(max(samples[leader]) < min(other) for i, other in enumerate(samples) if i != leader)


def _timed_call(candidate: Callable[[], object], clock: Clock) -> float | str:
    """Seconds one call took, or the error it raised (a candidate that raises is dropped)."""
    _wait_for_gpu()
    start_s = clock()
    try:
        candidate()
        _wait_for_gpu()
    except Exception as error:  # any failure only rules this candidate out
        return f"{type(error).__name__}: {error}"
    return clock() - start_s


def _wait_for_gpu() -> None:
    """Waits for the GPU work queued so far. A CUDA call returns once its kernels are queued:
    without this a candidate's time would be what launching it costs the host, and the work
    left queued by one candidate would be charged to the next."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
