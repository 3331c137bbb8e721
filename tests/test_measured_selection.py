"""Attention backends and their options chosen by measurement at the model's shapes.

Timings are injected: every candidate call still runs (where it can run here) on tiny shapes,
but a fake clock advances by the cost the test gives each candidate, so outcomes are exact and
nothing sleeps. The C kernels are made eligible on any CPU; where they cannot run here, their
candidate is a fake with the injected cost.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock

from vacpack import cpu_kernels
from vacpack.attention import (
    AttentionShapes,
    DecodeBatchShape,
    PackedBinShape,
    PagedPrefillShape,
    cascade_selection,
    select_backend,
    selection,
    timed_steps,
)
from vacpack.attention.backend import AttentionSpec
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY
from vacpack.attention.cascade_selection import PREFIX_BAND_FACTOR, cascade_shapes
from vacpack.attention.paged_decode import DECODE_FORMS, KERNEL_FORMS, kernel_form_supported
from vacpack.attention.step_routed import StepRoutedBackend
from vacpack.attention.timed_steps import TimedCall, Workload
from vacpack.tuning import ChoiceSource, force_env_var
from vacpack.tuning import cache as cache_module

CPU = torch.device("cpu")
KERNELS_RUN_HERE = cpu_kernels.varlen_attention_supported(CPU, torch.bfloat16, 32)
# Candidates whose real call runs here (the others only cost what they are given).
REAL_CALLS_RUN = {
    "cpu_kernels": KERNELS_RUN_HERE,
    "avx512_bf16": KERNELS_RUN_HERE,
    "amx": cpu_kernels.tile_kernel_ready("amx"),
}
# Too short for the blocked prefill (sdpa_prefill is not measured): only the backends are.
SHORT = AttentionShapes(4, 2, 32, torch.bfloat16, max_model_len=128)
LONG = AttentionShapes(4, 2, 32, torch.bfloat16, max_model_len=1024)
# Long enough for the blocked prefill, whose candidates are then timed on 256 tokens.
PREFILLS = AttentionShapes(4, 2, 32, torch.bfloat16, max_model_len=256)
BIN = PackedBinShape(2, 16)
DECODES = DecodeBatchShape(num_seqs=8, longest_context=40, page_size=16)

Cost = float | Exception
Costs = Mapping[str, Cost]


class InjectedTimings:
    """Wraps the real timed calls: each candidate's first call runs for real (where it can
    here), and every call costs what it is given (`prefill_costs` on paged prefill steps)."""

    def __init__(self, costs: Costs, prefill_costs: Costs | None = None) -> None:
        self.clock = FakeClock()
        self.costs, self.prefill_costs = dict(costs), prefill_costs
        self.calls: list[str] = []
        self.prefill_calls: list[str] = []  # those logged apart: where prefill_costs are given

    def wrap(self, calls: dict[str, TimedCall], workload: Workload) -> dict[str, TimedCall]:
        costs, log = self.costs, self.calls
        if self.prefill_costs is not None and isinstance(workload, PagedPrefillShape):
            costs, log = self.prefill_costs, self.prefill_calls
        return {name: self._fake(name, call, costs, log) for name, call in calls.items()}

    def _fake(self, name: str, real: TimedCall, costs: Costs, log: list[str]) -> TimedCall:
        def run() -> None:
            log.append(name)
            cost = costs[name]
            if isinstance(cost, Exception):
                raise cost
            first = log.count(name) == 1
            if first and REAL_CALLS_RUN.get(name, True):
                real()
            self.clock.now_s += cost

        return run


@pytest.fixture(autouse=True)
def kernels_eligible(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The default bf16 implementation only: the choice between it and the AMX kernel is
    # tested apart (test_amx_attention.py).
    monkeypatch.setattr(
        cpu_kernels,
        "varlen_attention_supported",
        lambda *args: len(args) < 4 or args[3] == cpu_kernels.DEFAULT_BF16_KERNEL,
    )
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))


@pytest.fixture
def inject(monkeypatch: pytest.MonkeyPatch):
    def install(costs: Costs, prefill_costs: Costs | None = None) -> InjectedTimings:
        timings = InjectedTimings(costs, prefill_costs)
        real = timed_steps.timed_calls

        def timed_calls(*args, **kwargs) -> dict[str, TimedCall]:
            return timings.wrap(real(*args, **kwargs), args[2])  # (backends, shapes, workload)

        monkeypatch.setattr(timed_steps, "timed_calls", timed_calls)
        return timings

    return install


def select(
    timings: InjectedTimings,
    shapes: AttentionShapes = SHORT,
    workload: Workload = BIN,
    name: str = "auto",
):
    return select_backend(name, CPU, shapes, workload, clock=timings.clock)


@pytest.mark.parametrize("fastest", ["cpu_kernels", "torch_sdpa"])
def test_auto_runs_the_faster_backend(inject, fastest: str) -> None:
    timings = inject({"cpu_kernels": 0.002, "torch_sdpa": 0.003} | {fastest: 0.001})
    selected = select(timings)
    assert selected.backend.name == fastest
    (choice,) = selected.choices
    assert choice.phase == "attention_packed" and choice.source is ChoiceSource.MEASURED
    assert choice.best_time_s[fastest] == pytest.approx(0.001)
    assert set(timings.calls) == {"cpu_kernels", "torch_sdpa"}


def test_each_phase_is_chosen_apart(inject, prefill_forced) -> None:
    timings = inject({"cpu_kernels": 0.001, "torch_sdpa": 0.002})
    encoder = select(timings, workload=PackedBinShape(2, 16, causal=False))
    assert encoder.choices[0].phase == "attention_encoder"
    timings.costs = {"cpu_kernels": 0.002, "torch_sdpa": 0.001, "cascade": 0.1, "no_cascade": 0.1}
    paged = select(timings, workload=DECODES)
    assert paged.choices[0].phase == "attention_paged" and paged.backend.name == "torch_sdpa"


def test_an_explicit_backend_is_taken_without_timing(inject) -> None:
    timings = inject({"cpu_kernels": 0.001, "torch_sdpa": 0.003})
    selected = select(timings, name="torch_sdpa")
    assert selected.backend.name == "torch_sdpa" and timings.calls == []
    assert [c.source for c in selected.choices] == [ChoiceSource.FORCED_ARGUMENT]


def test_the_environment_forces_a_backend(inject, monkeypatch: pytest.MonkeyPatch) -> None:
    timings = inject({"cpu_kernels": 0.001, "torch_sdpa": 0.003})
    monkeypatch.setenv(force_env_var("attention_packed"), "torch_sdpa")
    selected = select(timings)
    assert selected.backend.name == "torch_sdpa" and timings.calls == []
    assert selected.choices[0].source is ChoiceSource.FORCED_ENV
    # The argument outranks the environment; a name that is not a candidate is an error.
    assert select(timings, name="cpu_kernels").backend.name == "cpu_kernels"
    monkeypatch.setenv(force_env_var("attention_packed"), "flash")
    with pytest.raises(ValueError, match=r"'flash' \(set in VACPACK_CHOICE_ATTENTION_PACKED\)"):
        select(timings)


def test_a_cached_choice_times_nothing_and_a_new_key_retunes(
    inject, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = inject({"cpu_kernels": 0.001, "torch_sdpa": 0.003})
    assert select(timings).backend.name == "cpu_kernels"
    timings.calls.clear()
    timings.costs = {"cpu_kernels": 0.003, "torch_sdpa": 0.001}  # would now pick torch_sdpa
    cached = select(timings)
    assert cached.backend.name == "cpu_kernels" and timings.calls == []
    assert cached.choices[0].source is ChoiceSource.CACHED
    # Other heads, another bin, another torch: measured again.
    other_heads = AttentionShapes(8, 2, 32, torch.bfloat16, max_model_len=128)
    assert select(timings, shapes=other_heads).backend.name == "torch_sdpa"
    assert select(timings, workload=PackedBinShape(4, 16)).backend.name == "torch_sdpa"
    real_machine_key = cache_module.machine_key
    monkeypatch.setattr(
        cache_module, "machine_key", lambda: {**real_machine_key(), "torch": "9.9.9"}
    )
    new_torch = select(timings)
    assert new_torch.backend.name == "torch_sdpa"
    assert new_torch.choices[0].source is ChoiceSource.MEASURED


@pytest.mark.parametrize("content", ["{not json", json.dumps({"chosen": "torch_sdpa"})])
def test_a_corrupt_cache_file_is_measured_again(inject, tmp_path: Path, content: str) -> None:
    timings = inject({"cpu_kernels": 0.001, "torch_sdpa": 0.003})
    select(timings)
    (cache_file,) = tmp_path.glob("attention_packed-*.json")
    cache_file.write_text(content)
    timings.calls.clear()
    again = select(timings)
    assert again.choices[0].source is ChoiceSource.MEASURED and timings.calls
    assert again.backend.name == "cpu_kernels"
    assert json.loads(cache_file.read_text())["chosen"] == "cpu_kernels"


def test_a_backend_that_raises_is_skipped(inject) -> None:
    timings = inject({"cpu_kernels": RuntimeError("no kernel here"), "torch_sdpa": 0.003})
    selected = select(timings)
    assert selected.backend.name == "torch_sdpa"
    assert selected.choices[0].failed == {"cpu_kernels": "RuntimeError: no kernel here"}


def test_a_sole_candidate_is_taken_without_timing(inject) -> None:
    timings = inject({})
    odd_heads = AttentionShapes(4, 2, 12, torch.float32, max_model_len=128)  # no C kernel
    selected = select(timings, shapes=odd_heads)
    assert selected.backend.name == "torch_sdpa" and selected.choices == ()
    assert timings.calls == []
    windowed = AttentionShapes(
        4, 2, 32, torch.bfloat16, (AttentionSpec(sliding_window=8),), max_model_len=128
    )
    assert select(timings, shapes=windowed).backend.name == "torch_sdpa"  # the C kernel can't
    assert timings.calls == []


@pytest.mark.parametrize("fastest", ["sdpa", "blocked"])
def test_torch_sdpa_runs_long_prefills_as_measured(inject, fastest: str) -> None:
    costs = {"sdpa": 0.002, "blocked": 0.002, "cpu_kernels": 0.005, "torch_sdpa": 0.001}
    timings = inject(costs | {fastest: 0.001})
    selected = select(timings, shapes=PREFILLS)
    assert selected.backend.name == "torch_sdpa"
    assert selected.backend.blocked_prefill == (fastest == "blocked")
    prefill, backend = selected.choices[1], selected.choices[0]
    assert (prefill.phase, prefill.chosen) == ("sdpa_prefill", fastest)
    assert backend.phase == "attention_packed"
    # Decided before the backends were timed, so torch_sdpa competed in its faster form.
    assert timings.calls.index("torch_sdpa") > max(
        i for i, name in enumerate(timings.calls) if name in ("sdpa", "blocked")
    )


def test_no_prefill_choice_where_it_never_applies(inject) -> None:
    timings = inject({"cpu_kernels": 0.001, "torch_sdpa": 0.002})
    encoder = select(timings, shapes=LONG, workload=PackedBinShape(2, 16, causal=False))
    soft_capped = AttentionShapes(
        4, 2, 32, torch.bfloat16, (AttentionSpec(logit_softcap=30.0),), max_model_len=1024
    )
    capped = select(timings, shapes=soft_capped)
    for selected in (encoder, capped):
        assert "sdpa_prefill" not in [c.phase for c in selected.choices]


@pytest.fixture
def prefill_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_sdpa's prefill, decode and cascade prefix forms forced (slow in bf16, or absent)."""
    monkeypatch.setenv(force_env_var("sdpa_prefill"), "sdpa")
    monkeypatch.setenv(force_env_var("sdpa_decode"), "sdpa")
    monkeypatch.setenv(force_env_var("cascade_prefix"), "matmuls")


@pytest.mark.parametrize("fastest", ["cascade", "no_cascade"])
def test_decodes_sharing_a_prefix_cascade_as_measured(inject, prefill_forced, fastest: str) -> None:
    costs = {"cpu_kernels": 0.002, "torch_sdpa": 0.001}
    timings = inject(costs | {"cascade": 0.002, "no_cascade": 0.002, fastest: 0.001})
    selected = select(timings, shapes=LONG, workload=DECODES)
    expected = DEFAULT_CASCADE_POLICY if fastest == "cascade" else None
    assert selected.backend.cascade == expected
    options = ["sdpa_prefill", "sdpa_decode", "cascade_prefix"]
    assert [c.phase for c in selected.choices] == ["attention_paged", *options, "attention_cascade"]
    cascade = selected.choices[-1]
    assert cascade.chosen == fastest and "torch_sdpa" in cascade.shape_key


@pytest.mark.parametrize(
    ("cascade_wins", "min_prefix_tokens"),
    [
        ((True, True), 256),  # everywhere: the default policy
        ((False, True), 256 * PREFIX_BAND_FACTOR),  # only behind the longer prefix
        ((True, False), None),  # a win the longer prefix contradicts is not taken
        ((False, False), None),
    ],
)
def test_the_cascade_runs_from_the_shortest_prefix_it_won_from(
    prefill_forced,
    monkeypatch: pytest.MonkeyPatch,
    cascade_wins: tuple[bool, ...],
    min_prefix_tokens: int | None,
) -> None:
    """Timed behind two prefix lengths (the 64 decodes' shortest cascaded prefix, 256 tokens,
    and 1,024 in a 2,048-token context), the cascade runs from the shorter length from which
    it won every timing."""
    clock = FakeClock()
    real = timed_steps.timed_calls
    prefixes: list[int] = []

    def timed_calls(backends, shapes, workload, device, specs=None) -> dict[str, TimedCall]:
        assert set(backends) == {"cascade", "no_cascade"}  # the rest is forced
        real(backends, shapes, workload, device, specs)  # each candidate runs once, for real
        prefixes.append(workload.shared_prefix_tokens)
        wins = cascade_wins[len(prefixes) - 1]
        return {
            "cascade": clock.costing(0.001 if wins else 0.002),
            "no_cascade": clock.costing(0.002 if wins else 0.001),
        }

    monkeypatch.setattr(timed_steps, "timed_calls", timed_calls)
    shapes = AttentionShapes(4, 2, 32, torch.bfloat16, max_model_len=2048)
    decodes = DecodeBatchShape(num_seqs=64, longest_context=40, page_size=16)
    selected = select_backend("torch_sdpa", CPU, shapes, decodes, clock=clock)
    assert prefixes == [256, 256 * PREFIX_BAND_FACTOR]  # the third band does not fit
    cascades = [c for c in selected.choices if c.phase == "attention_cascade"]
    assert [c.chosen == "cascade" for c in cascades] == list(cascade_wins)
    policy = selected.backend.cascade
    if min_prefix_tokens is None:
        assert policy is None
    else:
        assert policy is not None and policy.min_prefix_tokens == min_prefix_tokens
        assert policy.min_saved_tokens == DEFAULT_CASCADE_POLICY.min_saved_tokens


@pytest.mark.parametrize("fastest", DECODE_FORMS)
def test_torch_sdpa_runs_decodes_as_measured(
    inject, monkeypatch: pytest.MonkeyPatch, fastest: str
) -> None:
    runs = {form: kernel_form_supported(form, CPU, LONG.dtype, 4, 2, 32) for form in KERNEL_FORMS}
    if not runs.get(fastest, True):
        pytest.skip(f"the {fastest} form's C kernel does not run here (no C compiler, or no AMX)")
    monkeypatch.setenv(force_env_var("sdpa_prefill"), "blocked")
    costs = {"cpu_kernels": 0.002, "torch_sdpa": 0.001, "cascade": 0.001, "no_cascade": 0.002}
    forms = {form: 0.002 for form in DECODE_FORMS}
    timings = inject(costs | forms | {fastest: 0.001})
    selected = select(timings, shapes=LONG, workload=DECODES)
    assert selected.backend.name == "torch_sdpa"
    assert selected.backend.decode_form == fastest
    decode = next(c for c in selected.choices if c.phase == "sdpa_decode")
    assert decode.chosen == fastest and decode.source is ChoiceSource.MEASURED
    assert "decode 8 seqs" in decode.shape_key
    # Each kernel form competes wherever it runs.
    for form, form_runs in runs.items():
        assert (form in decode.best_time_s) == form_runs
    # Decided before the backends were timed, so torch_sdpa competed in its faster form.
    assert timings.calls.index("torch_sdpa") > max(
        i for i, name in enumerate(timings.calls) if name in DECODE_FORMS
    )


def test_no_decode_choice_for_packed_bins_or_soft_capped_layers(inject, monkeypatch) -> None:
    monkeypatch.setenv(force_env_var("sdpa_prefill"), "sdpa")
    timings = inject({"cpu_kernels": 0.002, "torch_sdpa": 0.001, "cascade": 1, "no_cascade": 1})
    soft_capped = AttentionShapes(
        4, 2, 32, torch.bfloat16, (AttentionSpec(logit_softcap=30.0),), max_model_len=1024
    )
    for shapes, workload in ((LONG, BIN), (soft_capped, DECODES)):
        selected = select(timings, shapes=shapes, workload=workload)
        assert "sdpa_decode" not in [c.phase for c in selected.choices]
        assert selected.backend.decode_form == "matmuls"


def test_the_cascade_is_timed_from_the_shortest_prefix_it_runs_for() -> None:
    shortest, longer = cascade_shapes(DECODES, max_model_len=2500)
    assert shortest.num_seqs == longer.num_seqs == DECODES.num_seqs
    # 8 decodes save 7 reads of the prefix: 4,096 saved tokens need 592 (37 pages) of it.
    assert shortest.shared_prefix_tokens == 592
    assert longer.shared_prefix_tokens == 592 * PREFIX_BAND_FACTOR
    saved = (shortest.num_seqs - 1) * shortest.shared_prefix_tokens
    assert saved >= DEFAULT_CASCADE_POLICY.min_saved_tokens
    assert all(n > shortest.shared_prefix_tokens for n in shortest.context_lens())
    assert len(cascade_shapes(DECODES, max_model_len=1024)) == 1
    assert cascade_shapes(DECODES, max_model_len=600) == []  # no such prefix fits
    assert cascade_shapes(DecodeBatchShape(1, 40, 16), max_model_len=1024) == []


def test_no_cascade_choice_for_windowed_layers(inject, prefill_forced) -> None:
    timings = inject({"cpu_kernels": 0.002, "torch_sdpa": 0.001})
    windowed = AttentionShapes(
        4, 2, 32, torch.bfloat16, (AttentionSpec(sliding_window=64),), max_model_len=1024
    )
    selected = select(timings, shapes=windowed, workload=DECODES)
    assert "attention_cascade" not in [c.phase for c in selected.choices]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_timed_calls_run_the_candidates_on_the_same_inputs(dtype: torch.dtype) -> None:
    """The real calls, untouched, for a model alternating windowed and full layers: every
    candidate's layers give the same attention (each is checked against the float32
    reference in the attention tests)."""
    shapes = AttentionShapes(4, 2, 32, dtype, (AttentionSpec(sliding_window=8), AttentionSpec()))
    shared = DecodeBatchShape(8, 40, 16, shared_prefix_tokens=256)
    for workload, num_tokens in ((PackedBinShape(1, 300), 300), (shared, 8)):
        factories = {
            "sdpa": lambda: selection.create_backend("torch_sdpa", blocked_prefill=False),
            "blocked": lambda: selection.create_backend("torch_sdpa", blocked_prefill=True),
            "no_cascade": lambda: selection.create_backend("torch_sdpa", cascade=None),
            **{
                f"{form}_decode": functools.partial(
                    selection.create_backend, "torch_sdpa", cascade=None, decode_form=form
                )
                for form in DECODE_FORMS
                if form not in KERNEL_FORMS or kernel_form_supported(form, CPU, dtype, 4, 2, 32)
            },
        }
        calls = timed_steps.timed_calls(factories, shapes, workload, CPU)
        outputs = {name: call() for name, call in calls.items()}
        reference = outputs.pop("sdpa")
        assert len(reference) == 2 and reference[0].shape == (num_tokens, 4, 32)
        for layers in outputs.values():
            for got, expected in zip(layers, reference, strict=True):
                torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=0)


def test_a_candidate_that_cannot_run_raises_its_error_at_every_call() -> None:
    def no_backend() -> selection.AttentionBackend:
        raise RuntimeError("the C library did not build")

    calls = timed_steps.timed_calls(
        {"broken": no_backend, "sdpa": lambda: selection.create_backend("torch_sdpa")},
        SHORT,
        BIN,
        CPU,
    )
    for _ in range(2):
        with pytest.raises(RuntimeError, match="did not build"):
            calls["broken"]()
    assert calls["sdpa"]()[0].shape == (BIN.num_seqs * BIN.seq_len, 4, 32)


PREFILL_STEP = PagedPrefillShape(num_seqs=2, chunk_tokens=24, cached_tokens=8, page_size=16)


@pytest.mark.parametrize("prefill_fastest", ["cpu_kernels", "torch_sdpa"])
def test_prefill_steps_run_on_the_backend_that_wins_them(
    inject, prefill_forced, prefill_fastest: str
) -> None:
    """The decode batch and a prefill step are timed apart; where they pick different backends
    the engine's backend routes each step to its winner (as on an AMX Xeon: SDPA's flash kernel
    for prefill chunks, the C paged kernel for decodes)."""
    timings = inject(
        {"cpu_kernels": 0.001, "torch_sdpa": 0.002, "cascade": 0.1, "no_cascade": 0.1},
        prefill_costs={"cpu_kernels": 0.003, "torch_sdpa": 0.003} | {prefill_fastest: 0.001},
    )
    selected = select_backend(
        "auto", CPU, SHORT, DECODES, prefill_step=PREFILL_STEP, clock=timings.clock
    )
    prefill_choice = selected.choices[-1]
    assert prefill_choice.phase == "attention_paged_prefill"
    assert prefill_choice.chosen == prefill_fastest
    assert set(timings.prefill_calls) == {"cpu_kernels", "torch_sdpa"}
    if prefill_fastest == "cpu_kernels":
        assert selected.backend.name == "cpu_kernels"  # one backend for both kinds of step
    else:
        assert isinstance(selected.backend, StepRoutedBackend)
        assert selected.backend.decode.name == "cpu_kernels"
        assert selected.backend.prefill.name == "torch_sdpa"


def test_the_bf16_kernel_is_chosen_apart_for_prefill_steps(
    inject, prefill_forced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where both bf16 implementations run (an AMX Xeon), the C kernel backend's decodes and
    prefill steps each take the one that wins them: the engine's backend routes prefill steps
    to the cpu_kernels backend on AMX tiles, decodes to the one on AVX-512 registers."""
    monkeypatch.setattr(cpu_kernels, "varlen_attention_supported", lambda *args: True)
    # The backend built with the AMX kernel raises where the CPU lacks AMX, so it would lose.
    monkeypatch.setitem(REAL_CALLS_RUN, "cpu_kernels", REAL_CALLS_RUN["amx"])
    shared = {"cascade": 0.1, "no_cascade": 0.1, "cpu_kernels": 0.001, "torch_sdpa": 0.002}
    timings = inject(
        shared | {"avx512_bf16": 0.001, "amx": 0.002},
        prefill_costs=shared | {"avx512_bf16": 0.003, "amx": 0.001},
    )
    selected = select_backend(
        "auto", CPU, SHORT, DECODES, prefill_step=PREFILL_STEP, clock=timings.clock
    )
    bf16_choices = [c for c in selected.choices if c.phase == selection.BF16_KERNEL_PHASE]
    assert [c.chosen for c in bf16_choices] == ["avx512_bf16", "amx"]
    assert DECODES.key() in bf16_choices[0].shape_key
    assert PREFILL_STEP.key() in bf16_choices[1].shape_key
    backend = selected.backend
    assert isinstance(backend, StepRoutedBackend)
    assert backend.decode.name == backend.prefill.name == "cpu_kernels"
    assert backend.decode.bf16_kernel == "avx512_bf16"
    assert backend.prefill.bf16_kernel == "amx"


def test_the_cascade_prefixes_bf16_kernel_is_chosen_behind_a_shared_prefix(
    inject, prefill_forced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where both bf16 implementations run, the cpu_kernels backend's cascade prefixes get a
    choice of their own, timed behind the longest prefix the cascade is timed at, with the
    cascade on; the backend runs its prefixes on the winner."""
    monkeypatch.setattr(cpu_kernels, "varlen_attention_supported", lambda *args: True)
    # The backend built with the AMX prefix kernel raises where the CPU lacks AMX.
    monkeypatch.setitem(REAL_CALLS_RUN, "cpu_kernels", REAL_CALLS_RUN["amx"])
    # Not timed: its candidates' real calls would need the bf16 kernels on this CPU.
    monkeypatch.setenv(force_env_var(cascade_selection.CASCADE_PHASE), "cascade")
    timings = inject(
        {
            "cpu_kernels": 0.001,
            "torch_sdpa": 0.002,
            "cascade": 0.1,
            "no_cascade": 0.1,
            "avx512_bf16": 0.002,
            "amx": 0.001,
        }
    )
    selected = select(timings, shapes=LONG, workload=DECODES)
    phases = {c.phase: c for c in selected.choices}
    prefix_choice = phases[cascade_selection.BF16_PREFIX_KERNEL_PHASE]
    assert prefix_choice.chosen == "amx"
    longest_band = cascade_shapes(DECODES, LONG.max_model_len)[-1]
    assert prefix_choice.shape_key.endswith(longest_band.key())
    assert selected.backend.name == "cpu_kernels"
    assert selected.backend.prefix_bf16_kernel == "amx"  # type: ignore[attr-defined]


def test_a_forced_backend_runs_every_step(inject, prefill_forced) -> None:
    timings = inject({"cpu_kernels": 0.001, "torch_sdpa": 0.003, "cascade": 0.1, "no_cascade": 0.1})
    selected = select_backend(
        "torch_sdpa", CPU, SHORT, DECODES, prefill_step=PREFILL_STEP, clock=timings.clock
    )
    assert selected.backend.name == "torch_sdpa"
    assert not {"cpu_kernels", "torch_sdpa"} & set(timings.calls)  # no backend was timed
    forced = [c for c in selected.choices if c.source is ChoiceSource.FORCED_ARGUMENT]
    assert [c.phase for c in forced] == ["attention_paged", "attention_paged_prefill"]
