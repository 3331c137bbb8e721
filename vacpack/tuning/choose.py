"""Choosing among implementations of one phase by timing them once, on this machine, at the
model's own shapes, and remembering the answer.

A choice is made in this order:
1. a candidate named by the caller (`forced`), e.g. from a configuration field;
2. a candidate named by the environment variable VACPACK_CHOICE_<PHASE> (phase in capitals);
3. the only candidate, where there is one;
4. the cached result of an earlier measurement with the same key (see cache.py), once settled;
5. a measurement (timing.py), whose result is then cached.

A measurement left on fewer than SETTLED_ROUNDS timed rounds (its budget or the load's
allowance ran out) is cached unsettled: a later load uses it as it is once that load's own
allowance is spent, and before that times the rounds it lacks and adds them to the earlier
ones (each candidate keeps its best). A first load stays bounded, and one burst of other work
at the wrong moment does not decide a choice for good.

The fastest candidate wins, unless a `preferred` one is within `preferred_tolerance` of it: a
preference for reasons the clock does not see (memory, precision), kept while it costs little.

A measurement made under a load's timing allowance (allowance.py) is charged to it, and its
rounds get no more than the allowance has left.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from vacpack.tuning.allowance import FIRST_LOAD_TIMING_S, current_allowance
from vacpack.tuning.audit import remember
from vacpack.tuning.cache import ChoiceCache, choice_key, default_cache_dir
from vacpack.tuning.record import ChoiceSource, MeasuredChoice
from vacpack.tuning.timing import DEFAULT_MAX_ROUNDS, SETTLED_ROUNDS, Clock, time_candidates

logger = logging.getLogger(__name__)

# A phase that names no budget of its own may use a whole load's allowance.
DEFAULT_BUDGET_S = FIRST_LOAD_TIMING_S

# Seconds spent by measurements nested in the one under way: building one phase's candidates
# may measure another first (an attention backend's own options), whose time is its own, not
# the outer phase's (a report summing measure_s would count it twice).
_nested_measure_s: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "nested_measure_s", default=None
)


def force_env_var(phase: str) -> str:
    return f"VACPACK_CHOICE_{phase.upper()}"


def choose(
    phase: str,
    shape_key: str,
    candidate_names: Sequence[str],
    make_candidates: Callable[[], Mapping[str, Callable[[], object]]],
    *,
    forced: str | None = None,
    preferred: str | None = None,
    preferred_tolerance: float = 1.0,
    budget_s: float = DEFAULT_BUDGET_S,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
    cpu_clock: Clock | Literal["auto"] | None = "auto",
) -> MeasuredChoice:
    """The candidate to run for `phase` at `shape_key` (a short text naming the shapes and
    dtype the candidates are built for). `make_candidates` is called only when a measurement is
    needed (building inputs costs time and memory a cached choice should not spend): it returns
    one call per name in `candidate_names`, each running the phase once. `clock` and
    `cpu_clock` are timing.time_candidates'."""
    names = list(candidate_names)
    if not names:
        raise ValueError(f"{phase}: no candidates to choose from")
    if preferred is not None and preferred not in names:
        raise ValueError(f"{phase}: preferred {preferred!r} is not a candidate")
    forced_choice = _forced(phase, names, forced)
    if forced_choice is not None:
        source, name = forced_choice
        return MeasuredChoice(phase, shape_key, name, source)
    if len(names) == 1:
        return MeasuredChoice(phase, shape_key, names[0], ChoiceSource.ONLY_CANDIDATE)

    cache = ChoiceCache(cache_dir or default_cache_dir())
    key = choice_key(phase, shape_key, names)
    entry = cache.load(key)
    allowance = current_allowance()
    earlier = None
    if entry is not None:
        earlier = MeasuredChoice(
            phase,
            shape_key,
            entry["chosen"],
            ChoiceSource.CACHED,
            best_time_s=dict(entry["best_time_s"]),
            failed=dict(entry.get("failed", {})),
            num_rounds=int(entry.get("num_rounds", 0)),
        )
        if earlier.settled or (allowance is not None and allowance.remaining_s <= 0):
            remember(earlier, make_candidates)
            return earlier

    measure_start_s = clock()
    nested_s: list[float] = []
    token = _nested_measure_s.set(nested_s)
    try:
        candidates = make_candidates()
    finally:
        _nested_measure_s.reset(token)
    if sorted(candidates) != sorted(names):
        raise ValueError(f"{phase}: built candidates {sorted(candidates)}, named {sorted(names)}")
    # At least one timed round, whatever the budget says: warm-up times carry first calls' costs
    # (allocations, page faults, primitive creation, a library's first load), not what the
    # phase costs every step. A round costs about what the warm-up did, less those. Warm-up
    # times alone made PyTorch's SiLU-and-multiply look faster than the C kernel it trails 2x
    # at a first load on the Zen 3 (its 0.06 s budget spent by the warm-up).
    min_rounds = 1
    # Building the candidates' inputs counts, other phases measured meanwhile not (they charged
    # their own time).
    build_s = clock() - measure_start_s - sum(nested_s)
    if allowance is not None:
        allowance.charge(build_s)
    earlier_rounds = earlier.num_rounds if earlier is not None else 0
    if earlier is not None:
        # Settling an earlier choice: only the rounds it lacks, from whatever the load has
        # left: its settled choices cost it nothing this time.
        max_rounds = max(1, SETTLED_ROUNDS - earlier_rounds)
        if allowance is not None:
            budget_s = allowance.remaining_s
    elif allowance is not None:
        budget_s = allowance.grant(budget_s)  # a spent one still leaves the round above
    timings = time_candidates(
        candidates,
        budget_s=budget_s,
        max_rounds=max_rounds,
        min_rounds=min_rounds,
        clock=clock,
        cpu_clock=cpu_clock,
    )
    measure_s = clock() - measure_start_s - sum(nested_s)
    if allowance is not None:
        allowance.charge(measure_s - build_s)
    if not timings.best_time_s:
        errors = "; ".join(f"{name}: {error}" for name, error in timings.failed.items())
        raise RuntimeError(f"{phase}: every candidate failed ({errors})")
    best_time_s = timings.best_time_s
    if earlier is not None:  # this load goes on where an earlier one stopped
        best_time_s = {
            name: min(time_s, earlier.best_time_s.get(name, time_s))
            for name, time_s in best_time_s.items()
        }
    chosen = _pick(best_time_s, preferred, preferred_tolerance)
    choice = MeasuredChoice(
        phase,
        shape_key,
        chosen,
        ChoiceSource.MEASURED,
        best_time_s=best_time_s,
        failed=timings.failed,
        num_rounds=earlier_rounds + timings.num_rounds,
        measure_s=measure_s,
        stalled_calls=timings.num_stalled_calls,
    )
    enclosing = _nested_measure_s.get()
    if enclosing is not None:
        enclosing.append(measure_s + sum(nested_s))  # this phase's and its own nested ones
    cache.store(key, choice.to_dict())
    remember(choice, make_candidates)
    logger.info("measured choice: %s", choice.summary())
    return choice


def _forced(phase: str, names: list[str], forced: str | None) -> tuple[ChoiceSource, str] | None:
    """The argument's choice, else the environment's; a name that is not a candidate is an
    error rather than silently measured around."""
    env_var = force_env_var(phase)
    for source, name, where in (
        (ChoiceSource.FORCED_ARGUMENT, forced, "asked for"),
        (ChoiceSource.FORCED_ENV, os.environ.get(env_var) or None, f"set in {env_var}"),
    ):
        if name is None:
            continue
        if name not in names:
            raise ValueError(f"{phase}: {name!r} ({where}) is not one of the candidates {names}")
        return source, name
    return None


def _pick(best_time_s: dict[str, float], preferred: str | None, tolerance: float) -> str:
    fastest = min(best_time_s, key=best_time_s.__getitem__)
    if preferred in best_time_s and best_time_s[preferred] <= tolerance * best_time_s[fastest]:
        return preferred
    return fastest
