"""Auditing measured choices (vacpack.tuning.audit): every timed or cached choice is recorded
with what builds its candidates, and the audit times them again. Fake-clock timings first, then
a real tiny model's load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock

from vacpack import LLM
from vacpack.tuning import ChoiceSource, audit, choose, recording

PHASE = "audited_phase"


def test_recording_keeps_timed_and_cached_choices_once(tmp_path: Path) -> None:
    clock = FakeClock()
    candidates = {"a": clock.costing(0.002), "b": clock.costing(0.001)}
    with recording() as recorded:
        measured = choose(PHASE, "n=1", ["a", "b"], lambda: candidates, cache_dir=tmp_path,
                          clock=clock)  # fmt: skip
        cached = choose(PHASE, "n=1", ["a", "b"], lambda: candidates, cache_dir=tmp_path,
                        clock=clock)  # fmt: skip
        choose(PHASE, "n=2", ["a", "b"], lambda: candidates, forced="a", cache_dir=tmp_path)
        choose(PHASE, "n=3", ["a"], lambda: candidates, cache_dir=tmp_path)
    assert cached.source is ChoiceSource.CACHED and measured.source is ChoiceSource.MEASURED
    # Forced choices and sole candidates have nothing to audit; a phase and shape once.
    assert [r.choice for r in recorded] == [measured]
    assert recorded[0].make_candidates() is candidates
    # Outside the block nothing is kept.
    choose(PHASE, "n=4", ["a", "b"], lambda: candidates, cache_dir=tmp_path, clock=clock)
    assert len(recorded) == 1


def test_the_audit_finds_a_choice_that_no_longer_holds(tmp_path: Path) -> None:
    """A choice cached when b was faster; b has since become 3x slower than a."""
    clock = FakeClock()
    then = {"a": clock.costing(0.003), "b": clock.costing(0.001)}
    choose(PHASE, "n=1", ["a", "b"], lambda: then, cache_dir=tmp_path, clock=clock)
    now = {"a": clock.costing(0.001), "b": clock.costing(0.003)}
    right = {"a": clock.costing(0.001), "b": clock.costing(0.002)}
    with recording() as recorded:
        stale = choose(PHASE, "n=1", ["a", "b"], lambda: now,
                       cache_dir=tmp_path, clock=clock)  # fmt: skip
        choose(PHASE, "n=2", ["a", "b"], lambda: right, cache_dir=tmp_path, clock=clock)
    assert stale.source is ChoiceSource.CACHED and stale.chosen == "b"
    first, second = audit(recorded, rounds=5, clock=clock)
    assert first.fastest == "a" and first.chosen_over_fastest == pytest.approx(3.0)
    assert first.num_rounds == 5 and first.best_time_s == pytest.approx({"a": 0.001, "b": 0.003})
    assert second.choice.chosen == second.fastest == "a" and second.chosen_over_fastest == 1.0


def test_a_chosen_candidate_that_fails_in_the_audit_is_infinitely_slow(tmp_path: Path) -> None:
    clock = FakeClock()

    def broken() -> None:
        raise RuntimeError("kernel gone")

    built = iter([{"a": clock.costing(0.001), "b": clock.costing(0.002)},
                  {"a": broken, "b": clock.costing(0.002)}])  # fmt: skip
    with recording() as recorded:
        choose(PHASE, "n=1", ["a", "b"], lambda: next(built), cache_dir=tmp_path, clock=clock)
    (row,) = audit(recorded, rounds=3, clock=clock)
    assert "a" in row.failed and math.isinf(row.chosen_over_fastest) and row.fastest == "b"


def test_a_real_load_can_be_audited(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """Every choice of a tiny model's load and engine (linears, layer ops, attention) is
    rebuilt and timed again; each audit times every candidate the choice timed."""
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    with recording() as recorded:
        llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", device="cpu")
        choices = llm.loaded.measured_choices + llm.engine.setup.measured_choices
    keys = {(c.phase, c.shape_key) for c in choices}
    assert {(r.choice.phase, r.choice.shape_key) for r in recorded} == keys
    with torch.inference_mode():
        rows = audit(recorded, rounds=3, budget_s=0.2)
    for row in rows:
        timed = set(row.choice.best_time_s) | set(row.choice.failed)
        assert set(row.best_time_s) | set(row.failed) == timed
        assert row.num_rounds >= 3 and row.chosen_over_fastest >= 1.0
