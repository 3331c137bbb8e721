"""A loaded model runs what was chosen by measurement and says so: in EngineSetup, in a job's
report, and on a second load from the cache. Real timings on a tiny float32 model (the portable
backend is its sole attention backend; its prefill and decode kernels and cascade are timed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vacpack import LLM
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY
from vacpack.cpu_kernels.build import load_kernel_library
from vacpack.tuning import ChoiceSource

ENGINE_PHASES = ["sdpa_prefill", "sdpa_decode"]  # then one attention_cascade per prefix length


def test_a_loaded_model_reports_and_runs_its_choices(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    model_dir = str(tiny_checkpoint("qwen2"))
    llm = LLM(model_dir, dtype="float32", device="cpu")
    setup = llm.engine.setup
    phases = [c.phase for c in setup.measured_choices]
    assert phases[:2] == ENGINE_PHASES and phases[2:] and set(phases[2:]) == {"attention_cascade"}
    assert all(c.source is ChoiceSource.MEASURED for c in setup.measured_choices)
    prefill, decode, *cascades = setup.measured_choices
    assert set(prefill.best_time_s) == {"sdpa", "blocked"}
    kernel = {"kernel"} if load_kernel_library("paged_decode", portable=True) else set()
    assert set(decode.best_time_s) == {"sdpa", "matmuls"} | kernel
    assert all(set(c.best_time_s) == {"cascade", "no_cascade"} for c in cascades)
    # The engine runs what was chosen.
    attention = llm.engine.attention
    assert attention.name == setup.attention_backend == "torch_sdpa"
    assert attention.blocked_prefill == (prefill.chosen == "blocked")
    assert attention.decode_form == decode.chosen
    wins = [c.chosen == "cascade" for c in cascades]
    if not wins[-1]:  # lost behind the longest prefix: never a cascade
        assert attention.cascade is None
    elif all(wins):
        assert attention.cascade == DEFAULT_CASCADE_POLICY
    else:  # from a longer prefix than the default's
        assert attention.cascade is not None
        assert attention.cascade.min_prefix_tokens > DEFAULT_CASCADE_POLICY.min_prefix_tokens

    llm.embed(["a short text", "another one"], use_tqdm=False)
    report = llm.corpus_runner.last_report
    assert report is not None
    lines = [line for line in report.summary().splitlines() if "chosen by measurement" in line]
    # The prefill kernel: measured by the engine for the same shapes, read from the cache.
    assert len(lines) == 1 and "sdpa_prefill" in lines[0] and "(cached;" in lines[0]

    again = LLM(model_dir, dtype="float32", device="cpu").engine.setup
    assert [c.phase for c in again.measured_choices] == phases
    assert all(c.source is ChoiceSource.CACHED for c in again.measured_choices)
    assert [c.chosen for c in again.measured_choices] == [c.chosen for c in setup.measured_choices]
