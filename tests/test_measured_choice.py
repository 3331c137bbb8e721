"""Measured choices (vacpack.tuning): timings are injected through a fake clock that each
candidate advances by its own cost, so nothing sleeps and every outcome is exact."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock

from vacpack.tuning import (
    ChoiceCache,
    ChoiceSource,
    TimingAllowance,
    choose,
    force_env_var,
    spending,
)
from vacpack.tuning import cache as cache_module
from vacpack.tuning.cache import choice_key
from vacpack.tuning.timing import SETTLED_ROUNDS, time_candidates

PHASE = "test_phase"


def failing() -> None:
    raise RuntimeError("no kernel for this shape")


def make(candidates: dict[str, Callable[[], object]]) -> tuple[list[str], Callable]:
    return list(candidates), lambda: candidates


def choose_with(
    clock: FakeClock, cache_dir: Path, candidates: dict[str, Callable[[], object]], **kwargs
):
    return choose(PHASE, kwargs.pop("shape_key", "n=8"), *make(candidates), cache_dir=cache_dir,
                  clock=clock, **kwargs)  # fmt: skip


def time_with(
    clock: FakeClock, candidates: dict[str, Callable[[], object]], budget_s: float, max_rounds: int
):
    return time_candidates(candidates, budget_s=budget_s, max_rounds=max_rounds, clock=clock)


def total_calls(candidates: Iterable[Callable[[], object]]) -> int:
    return sum(len(getattr(c, "calls", [])) for c in candidates)


def test_picks_the_faster_candidate(tmp_path: Path) -> None:
    clock = FakeClock()
    candidates = {"slow": clock.costing(0.003), "fast": clock.costing(0.001)}
    choice = choose_with(clock, tmp_path, candidates)
    assert choice.chosen == "fast" and choice.source is ChoiceSource.MEASURED
    assert choice.best_time_s == pytest.approx({"slow": 0.003, "fast": 0.001})
    assert choice.num_rounds >= 1 and choice.measure_s == pytest.approx(clock.now_s)


def test_a_phase_measured_while_building_another_counts_only_for_itself(tmp_path: Path) -> None:
    """An attention backend's options are measured while its candidates are built: the outer
    phase's measure_s leaves the inner one's out, so that the two add up to the time spent."""
    clock = FakeClock()
    inner: list = []

    def build_outer() -> dict[str, Callable[[], object]]:
        inner_candidates = {"x": clock.costing(0.002), "y": clock.costing(0.004)}
        inner.append(choose("inner", "n=1", *make(inner_candidates), cache_dir=tmp_path,
                            clock=clock))  # fmt: skip
        return {"a": clock.costing(0.001), "b": clock.costing(0.003)}

    outer = choose(PHASE, "n=8", ["a", "b"], build_outer, cache_dir=tmp_path, clock=clock)
    assert inner[0].measure_s > 0 and outer.measure_s > 0
    assert inner[0].measure_s + outer.measure_s == pytest.approx(clock.now_s)


def test_best_of_interleaved_rounds_ignores_a_slowed_call(tmp_path: Path) -> None:
    clock = FakeClock()
    # The faster candidate's first timed call ran while the machine was busy.
    candidates = {"a": clock.costing(0.002), "b": clock.costing(0.001, 0.009, 0.001)}
    choice = choose_with(clock, tmp_path, candidates)
    assert choice.chosen == "b" and choice.best_time_s["b"] == pytest.approx(0.001)


def test_rounds_stop_within_the_time_budget() -> None:
    clock = FakeClock()
    timings = time_with(clock, {"a": clock.costing(0.01), "b": clock.costing(0.02)}, 0.1, 100)
    assert timings.elapsed_s <= 0.1 and timings.num_rounds == 2  # warm-up 0.03 + 2 x 0.03


def test_warm_up_times_stand_when_it_spent_the_budget() -> None:
    clock = FakeClock()
    timings = time_candidates(
        {"a": clock.costing(0.6), "b": clock.costing(0.5)}, budget_s=1.0, clock=clock
    )
    assert timings.num_rounds == 0 and timings.best_time_s == pytest.approx({"a": 0.6, "b": 0.5})


def test_rounds_stop_once_they_all_agree() -> None:
    clock = FakeClock()
    timings = time_with(clock, {"a": clock.costing(0.002), "b": clock.costing(0.001)}, 10.0, 100)
    assert timings.num_rounds == SETTLED_ROUNDS


def test_rounds_go_on_while_they_disagree() -> None:
    clock = FakeClock()
    # b's first timed call was slowed past a's time: three rounds do not all agree.
    timings = time_with(
        clock, {"a": clock.costing(0.002), "b": clock.costing(0.001, 0.003, 0.001)}, 10.0, 7
    )
    assert timings.num_rounds == 7 and timings.best_time_s == pytest.approx(
        {"a": 0.002, "b": 0.001}
    )


def test_rounds_end_cleanly_when_every_candidate_fails_after_its_warm_up() -> None:
    clock = FakeClock()

    def works_once() -> Callable[[], None]:
        calls = []

        def run() -> None:
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("out of memory")
            clock.now_s += 0.001

        return run

    timings = time_candidates(
        {"a": works_once(), "b": works_once()}, budget_s=1.0, enough_rounds=1, clock=clock
    )
    assert timings.best_time_s == {} and set(timings.failed) == {"a", "b"}


def test_a_choice_cut_short_is_timed_again_at_the_next_load(tmp_path: Path) -> None:
    """A first load with its allowance spent times one round, which a burst of other work
    decided wrongly; the next load adds rounds until the choice settles, then it is cached."""
    clock = FakeClock()
    with spending(TimingAllowance(total_s=0.0)):
        slowed_once = {"a": clock.costing(0.01), "b": clock.costing(0.005, 0.05, 0.005)}
        first = choose_with(clock, tmp_path, slowed_once)
    assert first.chosen == "a" and first.num_rounds == 1 and not first.settled
    assert "timed again at the next load" in first.summary()

    with spending(TimingAllowance()):
        second = choose_with(clock, tmp_path, {"a": clock.costing(0.01), "b": clock.costing(0.005)})
    assert second.source is ChoiceSource.MEASURED and second.chosen == "b"
    assert second.num_rounds == SETTLED_ROUNDS and second.settled  # 1 earlier + 2 that agree
    assert second.best_time_s == pytest.approx({"a": 0.01, "b": 0.005})

    rerun = {"a": clock.costing(0.01), "b": clock.costing(0.005)}
    with spending(TimingAllowance()):
        third = choose_with(clock, tmp_path, rerun)
    assert third.source is ChoiceSource.CACHED and third.chosen == "b"
    assert total_calls(rerun.values()) == 0


def test_settling_a_choice_may_use_what_the_load_has_left(tmp_path: Path) -> None:
    """A phase whose budget its warm-up spent settles at a later load, from that load's
    allowance rather than its own small budget (the settled phases cost the load nothing)."""
    clock = FakeClock()
    candidates = {"a": clock.costing(0.03), "b": clock.costing(0.02)}
    first = choose_with(clock, tmp_path, candidates, budget_s=0.06)
    assert first.num_rounds == 1 and first.chosen == "b" and not first.settled
    with spending(TimingAllowance(total_s=1.0)) as allowance:
        again = choose_with(clock, tmp_path, dict(candidates), budget_s=0.06)
    assert again.num_rounds == SETTLED_ROUNDS and again.settled and again.chosen == "b"
    # A warm-up of 0.05 s and the two rounds it lacked.
    assert allowance.spent_s == pytest.approx(again.measure_s) == pytest.approx(0.15)


def test_a_warm_up_slowed_by_first_call_costs_does_not_decide(tmp_path: Path) -> None:
    """Warm-up spent the phase's budget, and "a"'s first call paid for its allocations and its
    library's first load: one timed round still runs, and picks by it."""
    clock = FakeClock()
    candidates = {"a": clock.costing(0.05, 0.01), "b": clock.costing(0.02)}
    choice = choose_with(clock, tmp_path, candidates, budget_s=0.06)
    assert choice.num_rounds == 1 and choice.chosen == "a"
    assert choice.best_time_s == pytest.approx({"a": 0.01, "b": 0.02})


def test_an_unsettled_choice_stands_while_a_load_has_no_time_left(tmp_path: Path) -> None:
    clock = FakeClock()
    with spending(TimingAllowance(total_s=0.0)):
        choose_with(clock, tmp_path, {"a": clock.costing(0.01), "b": clock.costing(0.02)})
    rerun = {"a": clock.costing(0.01), "b": clock.costing(0.02)}
    with spending(TimingAllowance(total_s=0.0)):
        again = choose_with(clock, tmp_path, rerun)
    assert again.source is ChoiceSource.CACHED and again.chosen == "a" and not again.settled
    assert total_calls(rerun.values()) == 0


def test_phases_under_one_allowance_share_it(tmp_path: Path) -> None:
    """Each phase asks for 1 s; the load's allowance of 0.1 s is what they share."""
    clock = FakeClock()
    allowance = TimingAllowance(total_s=0.1)
    with spending(allowance):
        first = choose_with(clock, tmp_path, {"a": clock.costing(0.01), "b": clock.costing(0.01)},
                            shape_key="first", budget_s=1.0, max_rounds=100)  # fmt: skip
        second = choose_with(clock, tmp_path, {"a": clock.costing(0.01), "b": clock.costing(0.02)},
                             shape_key="second", budget_s=1.0, max_rounds=100)  # fmt: skip
    # 0.02 of warm-up, then rounds of 0.02 while they fit: 4 rounds.
    assert first.num_rounds == 4 and first.measure_s == pytest.approx(0.1)
    # Nothing left: the second still times one round after its warm-up, and picks by it.
    assert second.num_rounds == 1 and second.chosen == "a"
    assert second.measure_s == pytest.approx(0.06)
    assert allowance.spent_s == pytest.approx(clock.now_s) == pytest.approx(0.16)
    assert allowance.remaining_s == 0.0


def test_an_allowance_is_charged_once_for_a_nested_phase(tmp_path: Path) -> None:
    clock = FakeClock()
    allowance = TimingAllowance(total_s=10.0)

    def build_outer() -> dict[str, Callable[[], object]]:
        clock.now_s += 0.5  # building the outer phase's inputs
        choose("inner", "n=1", *make({"x": clock.costing(0.002), "y": clock.costing(0.004)}),
               cache_dir=tmp_path, clock=clock)  # fmt: skip
        return {"a": clock.costing(0.001), "b": clock.costing(0.003)}

    with spending(allowance):
        choose(PHASE, "n=8", ["a", "b"], build_outer, cache_dir=tmp_path, clock=clock)
    assert allowance.spent_s == pytest.approx(clock.now_s)


def test_cached_choices_spend_nothing_of_an_allowance(tmp_path: Path) -> None:
    clock = FakeClock()
    choose_with(clock, tmp_path, {"a": clock.costing(0.01), "b": clock.costing(0.02)})
    allowance = TimingAllowance()
    with spending(allowance):
        choice = choose_with(clock, tmp_path, {"a": clock.costing(0.01), "b": clock.costing(0.02)})
    assert choice.source is ChoiceSource.CACHED and allowance.spent_s == 0.0


def test_a_forced_argument_wins_without_timing(tmp_path: Path) -> None:
    clock = FakeClock()
    candidates = {"slow": clock.costing(0.003), "fast": clock.costing(0.001)}
    choice = choose_with(clock, tmp_path, candidates, forced="slow")
    assert choice.chosen == "slow" and choice.source is ChoiceSource.FORCED_ARGUMENT
    assert total_calls(candidates.values()) == 0 and not list(tmp_path.iterdir())


def test_the_environment_variable_forces_a_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    candidates = {"slow": clock.costing(0.003), "fast": clock.costing(0.001)}
    monkeypatch.setenv(force_env_var(PHASE), "slow")
    choice = choose_with(clock, tmp_path, candidates)
    assert choice.chosen == "slow" and choice.source is ChoiceSource.FORCED_ENV
    assert total_calls(candidates.values()) == 0
    # The argument outranks the environment.
    assert choose_with(clock, tmp_path, candidates, forced="fast").chosen == "fast"


def test_forcing_an_unknown_candidate_names_the_known_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    candidates = {"a": clock.costing(0.001), "b": clock.costing(0.001)}
    with pytest.raises(ValueError, match=r"'c' \(asked for\).*\['a', 'b'\]"):
        choose_with(clock, tmp_path, candidates, forced="c")
    monkeypatch.setenv(force_env_var(PHASE), "typo")
    with pytest.raises(ValueError, match=force_env_var(PHASE)):
        choose_with(clock, tmp_path, candidates)


def test_a_cached_choice_runs_nothing(tmp_path: Path) -> None:
    clock = FakeClock()
    first = choose_with(clock, tmp_path, {"a": clock.costing(0.003), "b": clock.costing(0.001)})
    rerun = {"a": clock.costing(0.001), "b": clock.costing(0.003)}  # would now pick a
    again = choose_with(clock, tmp_path, rerun)
    assert again.source is ChoiceSource.CACHED and again.chosen == first.chosen == "b"
    assert again.best_time_s == first.best_time_s and total_calls(rerun.values()) == 0


def test_a_new_key_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    assert (
        choose_with(clock, tmp_path, {"a": clock.costing(3), "b": clock.costing(1)}).chosen == "b"
    )
    # Other shapes.
    other_shape = choose_with(
        clock, tmp_path, {"a": clock.costing(1), "b": clock.costing(3)}, shape_key="n=16"
    )
    assert other_shape.source is ChoiceSource.MEASURED and other_shape.chosen == "a"
    # Another torch (or CPU, or vacpack) for the same shapes.
    real_machine_key = cache_module.machine_key
    monkeypatch.setattr(
        cache_module, "machine_key", lambda: {**real_machine_key(), "torch": "9.9.9"}
    )
    new_torch = choose_with(clock, tmp_path, {"a": clock.costing(1), "b": clock.costing(3)})
    assert new_torch.source is ChoiceSource.MEASURED and new_torch.chosen == "a"
    # Other C kernel sources (a kernel changed without a version bump).
    monkeypatch.setattr(cache_module, "kernel_sources_digest", lambda: "another kernel")
    monkeypatch.setattr(cache_module, "machine_key", real_machine_key)
    new_kernels = choose_with(clock, tmp_path, {"a": clock.costing(3), "b": clock.costing(1)})
    assert new_kernels.source is ChoiceSource.MEASURED and new_kernels.chosen == "b"
    # Another set of candidates.
    more = {"a": clock.costing(3), "b": clock.costing(3), "c": clock.costing(1)}
    assert choose_with(clock, tmp_path, more).chosen == "c"


@pytest.mark.parametrize(
    "content",
    ["{not json", "", json.dumps(["a list"]), json.dumps({"key": "wrong", "chosen": "a"})],
    ids=["truncated", "empty", "not-a-dict", "other-key"],
)
def test_a_corrupt_cache_file_is_measured_again_and_rewritten(tmp_path: Path, content: str) -> None:
    clock = FakeClock()
    key = choice_key(PHASE, "n=8", ["a", "b"])
    path = ChoiceCache(tmp_path).path_for(key)
    path.write_text(content)
    choice = choose_with(clock, tmp_path, {"a": clock.costing(0.003), "b": clock.costing(0.001)})
    assert choice.source is ChoiceSource.MEASURED and choice.chosen == "b"
    stored = json.loads(path.read_text())
    assert stored["key"] == key and stored["chosen"] == "b"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_a_cached_choice_of_a_vanished_candidate_is_measured_again(tmp_path: Path) -> None:
    clock = FakeClock()
    key = choice_key(PHASE, "n=8", ["a", "b"])
    ChoiceCache(tmp_path).store(key, {"chosen": "gone", "best_time_s": {}})
    choice = choose_with(clock, tmp_path, {"a": clock.costing(0.001), "b": clock.costing(0.003)})
    assert choice.source is ChoiceSource.MEASURED and choice.chosen == "a"


def test_a_candidate_that_raises_is_skipped(tmp_path: Path) -> None:
    clock = FakeClock()
    choice = choose_with(
        clock, tmp_path, {"broken": failing, "slow": clock.costing(0.003), "ok": clock.costing(2)}
    )
    assert choice.chosen == "slow" and set(choice.best_time_s) == {"slow", "ok"}
    assert choice.failed == {"broken": "RuntimeError: no kernel for this shape"}


def test_every_candidate_failing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"every candidate failed.*no kernel"):
        choose_with(FakeClock(), tmp_path, {"a": failing, "b": failing})


def test_a_preferred_candidate_wins_within_its_tolerance(tmp_path: Path) -> None:
    clock = FakeClock()
    close = {"preferred": clock.costing(0.0012), "other": clock.costing(0.001)}
    assert (
        choose_with(clock, tmp_path, close, preferred="preferred", preferred_tolerance=1.25).chosen
        == "preferred"
    )
    far = {"preferred": clock.costing(0.002), "other": clock.costing(0.001)}
    choice = choose_with(
        clock, tmp_path, far, preferred="preferred", preferred_tolerance=1.25, shape_key="n=2"
    )
    assert choice.chosen == "other"


def test_an_unwritable_cache_only_costs_a_later_measurement(tmp_path: Path) -> None:
    clock = FakeClock()
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the cache directory cannot be created under a file
    choice = choose_with(clock, blocked / "cache", {"a": clock.costing(1), "b": clock.costing(2)})
    assert choice.chosen == "a" and choice.source is ChoiceSource.MEASURED


def test_on_a_gpu_each_call_is_timed_to_the_end_of_its_queued_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA call returns once its kernels are queued: the timer waits for the device before
    starting and after each call (the GPU is stood in for; only its synchronize is observed)."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: events.append("sync"))
    time_candidates({"a": lambda: events.append("a")}, budget_s=0.0, max_rounds=0)
    assert events == ["sync", "a", "sync"]
