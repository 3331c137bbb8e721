"""dtype="auto" on a CPU: bfloat16 unless its matmuls are measured much slower than float32's;
a named dtype is always honoured. Timings are injected through a fake clock."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock

from vacpack.config import EngineConfig
from vacpack.corpus.report import JobReport
from vacpack.device import resolve_dtype
from vacpack.models import cpu_dtype
from vacpack.models.cpu_dtype import LinearShape, choose_cpu_dtype, linear_candidates
from vacpack.runtime import load
from vacpack.tuning import ChoiceSource, MeasuredChoice, force_env_var

CPU = torch.device("cpu")
SHAPE = LinearShape(num_rows=4, in_features=16, out_features=32)


def chosen_for(tmp_path: Path, bf16_s: float, fp32_s: float) -> MeasuredChoice:
    clock = FakeClock()
    candidates = {"bfloat16": clock.costing(bf16_s), "float32": clock.costing(fp32_s)}
    return choose_cpu_dtype(SHAPE, candidates=candidates, cache_dir=tmp_path, clock=clock)


def test_float32_where_bfloat16_is_much_slower(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=cpu_dtype.__name__):
        choice = chosen_for(tmp_path, bf16_s=0.007, fp32_s=0.001)
    assert choice.chosen == "float32" and choice.source is ChoiceSource.MEASURED
    assert resolve_dtype("auto", torch.bfloat16, CPU, choice) == torch.float32
    (line,) = [r.getMessage() for r in caplog.records if r.name == cpu_dtype.__name__]
    assert "float32" in line and "7.0x slower" in line


@pytest.mark.parametrize("bf16_s", [0.0011, 0.0005], ids=["slightly-slower", "faster"])
def test_bfloat16_where_it_is_about_as_fast(tmp_path: Path, bf16_s: float) -> None:
    choice = chosen_for(tmp_path, bf16_s=bf16_s, fp32_s=0.001)
    assert choice.chosen == "bfloat16"
    assert resolve_dtype("auto", torch.bfloat16, CPU, choice) == torch.bfloat16


def test_a_named_dtype_is_always_honoured(tmp_path: Path) -> None:
    slow_bf16 = chosen_for(tmp_path, bf16_s=0.007, fp32_s=0.001)
    assert resolve_dtype("bfloat16", torch.bfloat16, CPU, slow_bf16) == torch.bfloat16
    assert resolve_dtype("float32", torch.bfloat16, CPU, None) == torch.float32


def test_both_candidates_run_the_same_linear() -> None:
    outputs = {name: run() for name, run in linear_candidates(SHAPE).items()}
    assert outputs["float32"].shape == (SHAPE.num_rows, SHAPE.out_features)
    torch.testing.assert_close(
        outputs["bfloat16"].float(), outputs["float32"], atol=2e-2, rtol=2e-2
    )


def test_loading_with_a_named_dtype_does_not_measure_the_dtype(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_run(*args: object, **kwargs: object) -> MeasuredChoice:
        raise AssertionError("a named dtype was measured")

    monkeypatch.setattr("vacpack.runtime.choose_cpu_dtype", must_not_run)
    loaded = load(EngineConfig(str(tiny_checkpoint("qwen2")), dtype="bfloat16", device="cpu"))
    # Its arithmetic is bfloat16 as the suite forces it (conftest.py), and so reported.
    assert loaded.dtype == torch.bfloat16
    # Only the dtype's choice: a CPU with bf16 instructions also times bf16 layer kernels.
    (arithmetic,) = [c for c in loaded.measured_choices if c.phase == cpu_dtype.ARITHMETIC_PHASE]
    assert arithmetic.source is ChoiceSource.FORCED_ENV


def test_loading_with_auto_follows_the_measured_choice(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    model_dir = str(tiny_checkpoint("qwen2"))
    measured = load(EngineConfig(model_dir, dtype="auto", device="cpu"))
    # The dtype first; where it is float32 the layer ops' choices follow (fused kernels run).
    choice = measured.measured_choices[0]
    assert choice.phase == "cpu_dtype" and choice.source is ChoiceSource.MEASURED
    assert set(choice.best_time_s) == {"bfloat16", "float32"}
    assert measured.dtype == cpu_dtype.DTYPES[choice.chosen]
    assert next(measured.model.parameters()).dtype == measured.dtype
    # The next load takes it from the cache; the environment variable overrides it.
    assert (
        load(EngineConfig(model_dir, device="cpu")).measured_choices[0].source
        is ChoiceSource.CACHED
    )
    monkeypatch.setenv(force_env_var(cpu_dtype.PHASE), "float32")
    forced = load(EngineConfig(model_dir, device="cpu"))
    assert forced.dtype == torch.float32
    assert forced.measured_choices[0].source is ChoiceSource.FORCED_ENV


def test_a_job_report_shows_the_measured_choice(tmp_path: Path) -> None:
    choice = chosen_for(tmp_path, bf16_s=0.007, fp32_s=0.001)
    report = JobReport("embed", measured_choices=(choice,))
    assert "chosen by measurement: cpu_dtype [linear [4, 16] x [16, 32]]: float32" in (
        report.summary()
    )
    assert choice.to_dict()["best_time_s"] == pytest.approx({"bfloat16": 0.007, "float32": 0.001})
