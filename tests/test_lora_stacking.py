"""vacpack/lora/stacking.py: where a step's adapters stop running stacked, chosen by timing
(injected here), forced by the environment, and timed for real on a small shape."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock

from vacpack.lora import stacking
from vacpack.lora.stacking import StackingShape, choose_stacked_max_rows
from vacpack.tuning.choose import force_env_var
from vacpack.tuning.record import ChoiceSource

CPU = torch.device("cpu")
SHAPE = StackingShape(in_features=32, out_features=64, num_adapters=3, rank=4, dtype=torch.float32)


@pytest.fixture(autouse=True)
def own_choice_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test's choices in a cache of its own (the suite's is shared by every test)."""
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))


def _injected(
    clock: FakeClock, stacked_wins_up_to: int, timed: list[int]
) -> Callable[[StackingShape, int, torch.device], dict[str, Callable[[], object]]]:
    def candidates(
        shape: StackingShape, num_rows: int, device: torch.device
    ) -> dict[str, Callable[[], object]]:
        timed.append(num_rows)
        stacked_s, gathered_s = (1e-4, 2e-4) if num_rows <= stacked_wins_up_to else (2e-4, 1e-4)
        return {"stacked": clock.costing(stacked_s), "gathered": clock.costing(gathered_s)}

    return candidates


@pytest.mark.parametrize("stacked_wins_up_to", [0, 8, 32, 256])
def test_the_threshold_is_the_last_row_count_stacking_wins(
    monkeypatch: pytest.MonkeyPatch, stacked_wins_up_to: int
) -> None:
    clock, timed = FakeClock(), []
    monkeypatch.setattr(stacking, "_candidates", _injected(clock, stacked_wins_up_to, timed))
    rows, choices = choose_stacked_max_rows(SHAPE, CPU, clock=clock)
    assert rows == stacked_wins_up_to
    # Timed in doubling counts until gathering wins (never past the largest count).
    expected_timed = [n for n in stacking.ROW_COUNTS if n <= stacked_wins_up_to]
    if stacked_wins_up_to < stacking.ROW_COUNTS[-1]:
        expected_timed.append(stacking.ROW_COUNTS[len(expected_timed)])
    assert timed == expected_timed
    assert [c.phase for c in choices] == [stacking.PHASE] * len(timed)
    assert all(c.source is ChoiceSource.MEASURED for c in choices)
    assert choices[-1].shape_key == SHAPE.key(timed[-1])
    assert "3 adapters of rank 4, 32 -> 64, float32" in choices[0].shape_key


def test_a_cached_choice_is_not_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, timed = FakeClock(), []
    monkeypatch.setattr(stacking, "_candidates", _injected(clock, 16, timed))
    first, _ = choose_stacked_max_rows(SHAPE, CPU, clock=clock)
    timed.clear()
    again, choices = choose_stacked_max_rows(SHAPE, CPU, clock=clock)
    assert (first, again, timed) == (16, 16, [])
    assert all(c.source is ChoiceSource.CACHED for c in choices)


@pytest.mark.parametrize(("forced", "rows"), [("stacked", 256), ("gathered", 0)])
def test_a_forced_form_is_taken_untimed(
    monkeypatch: pytest.MonkeyPatch, forced: str, rows: int
) -> None:
    monkeypatch.setenv(force_env_var(stacking.PHASE), forced)
    monkeypatch.setattr(stacking, "_candidates", lambda *args: pytest.fail("timed"))
    assert choose_stacked_max_rows(SHAPE, CPU)[0] == rows


def test_one_adapter_a_step_never_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacking, "_candidates", lambda *args: pytest.fail("timed"))
    single = StackingShape(32, 64, num_adapters=1, rank=4, dtype=torch.float32)
    assert choose_stacked_max_rows(single, CPU) == (0, ())


def test_both_forms_are_timed_for_real_on_the_layers_code() -> None:
    rows, choices = choose_stacked_max_rows(SHAPE, CPU)
    assert rows in (0, *stacking.ROW_COUNTS)
    assert choices and all(set(c.best_time_s) == {"stacked", "gathered"} for c in choices)
    # The two forms compute the same delta.
    outputs = {}
    for name, call in stacking._candidates(SHAPE, 16, CPU).items():
        outputs[name] = call()  # each adds once to its own copy of y
    torch.testing.assert_close(outputs["stacked"], outputs["gathered"])
