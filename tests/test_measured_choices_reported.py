"""A loaded model runs what was chosen by measurement and says so: in EngineSetup, in a job's
report, and on a second load from the cache. Real timings on a tiny float32 model (the portable
backend's prefill and decode kernels and cascade are timed, and where the float32 C attention
kernel builds, the form of the cascade's prefixes and the two backends against each other for
decodes and for prefill steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vacpack import LLM
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY
from vacpack.cpu_kernels import varlen_attention_supported
from vacpack.cpu_kernels.build import load_kernel_library
from vacpack.cpu_kernels.elementwise import elementwise_kernels_available
from vacpack.models.layer_ops_choice import DECODER_LAYER_OP_PHASES
from vacpack.models.linear_choice import eligible_linear_kernels
from vacpack.tuning import ChoiceSource

CPU = torch.device("cpu")
# torch_sdpa's options, then one attention_cascade per prefix length.
OPTION_PHASES = ["sdpa_prefill", "sdpa_decode"]


def test_a_loaded_model_reports_and_runs_its_choices(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    model_dir = str(tiny_checkpoint("qwen2"))
    llm = LLM(model_dir, dtype="float32", device="cpu")
    setup = llm.engine.setup
    two_backends = varlen_attention_supported(CPU, torch.float32, llm.loaded.config.head_dim)
    phases = [c.phase for c in setup.measured_choices]
    assert all(c.source is ChoiceSource.MEASURED for c in setup.measured_choices)
    choices = list(setup.measured_choices)
    if two_backends:  # the backends for decodes first, for prefill steps last
        decodes, *choices, prefills = choices
        assert (decodes.phase, prefills.phase) == ("attention_paged", "attention_paged_prefill")
        assert (
            set(decodes.best_time_s) == set(prefills.best_time_s) == {"cpu_kernels", "torch_sdpa"}
        )
    prefill, decode, *cascades = choices
    assert [prefill.phase, decode.phase] == OPTION_PHASES
    # Where the C attention kernel runs, the form of the cascade's prefixes comes first.
    if two_backends:
        prefix_form, *cascades = cascades
        assert prefix_form.phase == "cascade_prefix"
        assert set(prefix_form.best_time_s) == {"matmuls", "kernel"}
    assert cascades and {c.phase for c in cascades} == {"attention_cascade"}
    assert set(prefill.best_time_s) == {"sdpa", "blocked"}
    # The tiny model groups several query heads per KV head: both of the C kernel's forms.
    kernel = (
        {"kernel", "kernel_lanes"} if load_kernel_library("paged_decode", portable=True) else set()
    )
    assert set(decode.best_time_s) == {"sdpa", "matmuls"} | kernel
    assert all(set(c.best_time_s) == {"cascade", "no_cascade"} for c in cascades)
    # The engine runs what was chosen: decodes on one backend, prefill steps on another where
    # another won them.
    attention = llm.engine.attention
    decoding = getattr(attention, "decode", attention)
    if two_backends:
        assert decoding.name == decodes.chosen
        assert getattr(attention, "prefill", attention).name == prefills.chosen
    else:
        assert attention.name == setup.attention_backend == "torch_sdpa"
    if decoding.name == "torch_sdpa":
        assert decoding.blocked_prefill == (prefill.chosen == "blocked")
        assert decoding.decode_form == decode.chosen
        assert decoding.prefix_form == (prefix_form.chosen if two_backends else "matmuls")
    wins = [c.chosen == "cascade" for c in cascades]
    if not wins[-1]:  # lost behind the longest prefix: never a cascade
        assert decoding.cascade is None
    elif all(wins):
        assert decoding.cascade == DEFAULT_CASCADE_POLICY
    else:  # from a longer prefix than the default's
        assert decoding.cascade is not None
        assert decoding.cascade.min_prefix_tokens > DEFAULT_CASCADE_POLICY.min_prefix_tokens

    llm.embed(["a short text", "another one"], use_tqdm=False)
    report = llm.corpus_runner.last_report
    assert report is not None
    lines = [line for line in report.summary().splitlines() if "chosen by measurement" in line]
    # The prefill kernel: measured by the engine for the same shapes, read from the cache; and
    # the model's layer ops and its linears' kernel, measured at its load, where the float32 C
    # kernels build.
    prefill_lines = [line for line in lines if "sdpa_prefill" in line]
    assert len(prefill_lines) == 1 and "(cached, " in prefill_lines[0]
    # With two backends the corpus job times them on its bin (attention_packed) too.
    layer_ops = elementwise_kernels_available(CPU, torch.float32)
    # One linear-kernel choice per weight shape where the C kernel competes.
    linears = [c for c in llm.loaded.measured_choices if c.phase == "cpu_linear"]
    assert bool(linears) == (len(eligible_linear_kernels(CPU, torch.float32)) > 1)
    assert len(lines) == 1 + two_backends + (
        len(DECODER_LAYER_OP_PHASES) if layer_ops else 0
    ) + len(linears)
    # Every measurement of the load, the engine's and the corpus job's included, was charged
    # to the load's one timing allowance.
    # (The corpus runner's list starts with the load's; a cached choice measured nothing.)
    measured = setup.measured_choices + llm.corpus_runner.measured_choices
    spent_s = llm.loaded.timing_allowance.spent_s
    assert spent_s > 0 and spent_s == pytest.approx(sum(c.measure_s or 0 for c in measured))

    again_llm = LLM(model_dir, dtype="float32", device="cpu")
    again = again_llm.engine.setup
    # A backend's options are asked for when it is timed or chosen: read from the cache, a
    # choice of the C kernel for decodes times no backend, so torch_sdpa's options (timed with
    # it at the first load) are not read again, and not reported.
    again_decodes = again.measured_choices[0] if two_backends else None
    sdpa_options_unread = (
        again_decodes is not None
        and again_decodes.source is ChoiceSource.CACHED
        and again_decodes.chosen != "torch_sdpa"
    )
    unread = {*OPTION_PHASES, "cascade_prefix"} if sdpa_options_unread else set()
    assert [c.phase for c in again.measured_choices] == [p for p in phases if p not in unread]
    # A settled choice is read from the cache; one that a busy machine left on too few rounds
    # (rare on these tiny shapes) is timed again while the load has time left, its rounds
    # added to the earlier ones.
    first_choices = llm.loaded.measured_choices + tuple(
        c for c in setup.measured_choices if c.phase not in unread
    )
    again_choices = again_llm.loaded.measured_choices + again.measured_choices
    for first, second in zip(first_choices, again_choices, strict=True):
        if second.source is ChoiceSource.MEASURED:
            assert not first.settled and second.num_rounds > first.num_rounds
        else:
            assert second.source is ChoiceSource.CACHED and second.chosen == first.chosen
    if all(c.settled for c in first_choices):
        assert again_llm.loaded.timing_allowance.spent_s == 0.0
