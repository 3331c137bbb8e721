"""Which attention backend runs a phase, and with which options: timed at the model's shapes.

`attention_backend="auto"` times every eligible backend that runs all of the model's layers
(windows, scales, softcaps) on one layer of the phase's own workload (timed_steps.py) and takes
the fastest, through vacpack.tuning: interleaved rounds, best of, within a time budget, cached
on disk per CPU, torch, vacpack and shapes, so a later load times nothing. A sole candidate is
taken without timing; a backend named in `attention_backend`, or in the environment variable
VACPACK_CHOICE_<PHASE>, is taken as it is.

Options of a backend are measured the same way, each a phase of its own:
- sdpa_prefill: whether torch_sdpa runs long causal prefills as SDPA or as blocked matmuls
  (blocked_prefill.py), on a CPU. Decided before the backends are timed, so that torch_sdpa
  competes in its faster form.
- sdpa_decode: how torch_sdpa runs decodes: as plain matmuls, through SDPA's kernel, or
  through the C kernel that reads pages in place where it builds, in either of its forms
  (grouped query heads apart or in vector lanes; paged_decode.py), timed on
  the engine's decode batch. Also decided before the backends are timed.
- cascade_prefix: how torch_sdpa's cascade attends a shared prefix: as matmuls or through the
  C varlen kernel (cascade.py), on a CPU where that kernel runs for the model's dtype and head
  size. Timed on the engine's decode batch behind the longest prefix the cascade is timed at,
  after sdpa_decode (the cascade's own pages run in that form).
- cpu_bf16_kernel: which implementation runs the cpu_kernels backend's bf16 calls: the
  AVX-512 kernel or the AMX one (its products on tiles), on a CPU where both run. Timed on the
  phase's own workload (a corpus bin; the engine's decode batch), and for the engine on its
  prefill step too: where the two differ, steps with prefill run on the cpu_kernels backend with
  the implementation that won them (step_routed.py).
- cpu_bf16_prefix_kernel: the same choice for the cpu_kernels backend's cascade prefixes (all
  the decodes sharing a prefix over its keys in one call), timed behind the longest prefix the
  cascade is timed at.
- attention_cascade: from which shared prefix length decodes sharing a prefix run as a cascade
  (cascade.py), for the chosen backend where it takes one. Timed on the engine's decode batch
  behind prefixes of a few lengths (PREFIX_BANDS), from the shortest the policy cascades: where
  the plain decode reads pages fast (a C kernel), the cascade pays only for long prefixes, so
  the policy starts at the shortest length from which the cascade won every timing.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

# Timing goes through timed_steps.timed_calls, named by its module here and in the modules
# below, so that one patch (a test's injected timings) reaches every choice.
from vacpack.attention import timed_steps
from vacpack.attention.backend import AttentionBackend
from vacpack.attention.blocked_prefill import MIN_KEYS
from vacpack.attention.cascade_selection import (
    cascade_policy,
    choose_cascade,
    choose_prefix_bf16_kernel,
    choose_prefix_form,
)
from vacpack.attention.option_timing import Measure, bf16_kernels_here, measure_option
from vacpack.attention.paged_decode import KERNEL_FORMS, kernel_form_supported
from vacpack.attention.registry import (
    SPECS_BY_NAME,
    Phase,
    auto_candidates,
    create_backend,
    resolve_backend_name,
    unsupported_reasons,
)
from vacpack.attention.step_routed import StepRoutedBackend
from vacpack.attention.timed_steps import (
    AttentionShapes,
    DecodeBatchShape,
    PackedBinShape,
    PagedPrefillShape,
    TimedCall,
    Workload,
)
from vacpack.tuning import ChoiceSource, MeasuredChoice, choose
from vacpack.tuning.timing import Clock

# Each choice's share of the ~2 s that a first load may spend timing (the dtype takes 0.75 s;
# the cascade's choices have theirs in cascade_selection.py).
BACKEND_BUDGET_S = 0.3
PREFILL_BUDGET_S = 0.25
DECODE_BUDGET_S = 0.25
BF16_KERNEL_BUDGET_S = 0.2

SDPA_PREFILL_PHASE = "sdpa_prefill"
SDPA_DECODE_PHASE = "sdpa_decode"
BF16_KERNEL_PHASE = "cpu_bf16_kernel"
# The prefill timed for sdpa_prefill: long enough to be past MIN_KEYS, where the choice applies,
# short enough that a slow candidate's one call stays within the budget.
PREFILL_TIMED_TOKENS = 512


@dataclass(frozen=True)
class SelectedBackend:
    backend: AttentionBackend
    # How the backend and its options were chosen (measured, cached or forced), with the
    # timings that chose them; a choice with a sole candidate is left out.
    choices: tuple[MeasuredChoice, ...]


def backend_phase(workload: Workload) -> str:
    """The measured-choice phase of a workload: attention_packed, attention_encoder (packed,
    bidirectional), attention_paged (the engine's decodes) or attention_paged_prefill (its
    prefill steps); VACPACK_CHOICE_<PHASE> forces its backend."""
    if isinstance(workload, DecodeBatchShape):
        return "attention_paged"
    if isinstance(workload, PagedPrefillShape):
        return "attention_paged_prefill"
    return "attention_packed" if workload.causal else "attention_encoder"


def select_backend(
    name: str,
    device: torch.device,
    shapes: AttentionShapes,
    workload: PackedBinShape | DecodeBatchShape,
    *,
    prefill_step: PagedPrefillShape | None = None,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
) -> SelectedBackend:
    """The backend for `workload`'s phase: `name` ("auto": the fastest eligible one that runs
    every layer of the model), with its options measured.

    For the engine (a decode batch), `prefill_step` times the candidates on a step of prefill
    chunks too; where another backend wins there, steps with prefill run on it (step_routed.py).
    """
    phase = Phase.PAGED if isinstance(workload, DecodeBatchShape) else Phase.PACKED
    eligible = (
        auto_candidates(device, shapes.dtype, shapes.head_dim, phase)
        if name == "auto"
        else [resolve_backend_name(name, device, shapes.dtype, shapes.head_dim, phase)]
    )
    runnable: list[str] = []
    reasons: list[str] = []
    for candidate in eligible:
        why_not = unsupported_reasons(create_backend(candidate), shapes.specs)
        if why_not:
            reasons.extend(why_not)
        else:
            runnable.append(candidate)
    if name != "auto" and reasons:
        raise ValueError(
            f"attention backend {name!r} cannot run this model: {'; '.join(reasons)}. "
            "Use attention_backend='auto' or 'torch_sdpa'"
        )
    if not runnable:
        raise ValueError(f"no attention backend runs this model here: {'; '.join(reasons)}")

    tuned: list[MeasuredChoice] = []
    measure: Measure = functools.partial(choose, cache_dir=cache_dir, clock=clock)

    def options_of(backend_name: str, timed: Workload | None = None) -> tuple[tuple[str, Any], ...]:
        """The measured options of a backend, measured when first asked for: on the phase's
        workload, but for the bf16 kernel, which is chosen on `timed` where given (an AMX
        kernel may win the engine's prefill steps and lose its decodes)."""
        return measured_options(backend_name, workload if timed is None else timed)

    @functools.cache
    def measured_options(backend_name: str, timed: Workload) -> tuple[tuple[str, Any], ...]:
        declared = SPECS_BY_NAME[backend_name].options
        if timed != workload:
            options = dict(options_of(backend_name))
            if "bf16_kernel" in declared:
                bf16_kernel = _choose_bf16_kernel(device, shapes, timed, measure)
                if bf16_kernel is not None:
                    tuned.append(bf16_kernel)
                    options["bf16_kernel"] = bf16_kernel.chosen
            return tuple(options.items())
        options_list: list[tuple[str, Any]] = []
        if "blocked_prefill" in declared:
            prefill = _choose_sdpa_prefill(device, shapes, workload, measure)
            if prefill is not None:
                tuned.append(prefill)
                options_list.append(("blocked_prefill", prefill.chosen == "blocked"))
        if "decode_form" in declared and isinstance(workload, DecodeBatchShape):
            decode = _choose_decode_form(device, shapes, workload, measure)
            if decode is not None:
                tuned.append(decode)
                options_list.append(("decode_form", decode.chosen))
        if "bf16_kernel" in declared:
            bf16_kernel = _choose_bf16_kernel(device, shapes, workload, measure)
            if bf16_kernel is not None:
                tuned.append(bf16_kernel)
                options_list.append(("bf16_kernel", bf16_kernel.chosen))
        if "prefix_bf16_kernel" in declared and isinstance(workload, DecodeBatchShape):
            prefix_kernel = choose_prefix_bf16_kernel(
                device, shapes, workload, dict(options_list), measure
            )
            if prefix_kernel is not None:
                tuned.append(prefix_kernel)
                options_list.append(("prefix_bf16_kernel", prefix_kernel.chosen))
        if "prefix_form" in declared and isinstance(workload, DecodeBatchShape):
            prefix_form = choose_prefix_form(device, shapes, workload, dict(options_list), measure)
            if prefix_form is not None:
                tuned.append(prefix_form)
                options_list.append(("prefix_form", prefix_form.chosen))
        return tuple(options_list)

    def build(backend_name: str, timed: Workload | None = None, **options: Any) -> AttentionBackend:
        return create_backend(backend_name, **dict(options_of(backend_name, timed)), **options)

    def choose_backend(timed: Workload) -> MeasuredChoice:
        def backend_calls() -> dict[str, TimedCall]:
            for backend_name in runnable:
                options_of(backend_name, timed)  # measured first: not the backends' timing
            factories = {n: functools.partial(build, n, timed) for n in runnable}
            return timed_steps.timed_calls(factories, shapes, timed, device)

        return measure(
            backend_phase(timed),
            f"{shapes.key()}; {timed.key()}",
            runnable,
            backend_calls,
            forced=None if name == "auto" else name,
            budget_s=BACKEND_BUDGET_S,
        )

    backend_choice = choose_backend(workload)
    chosen = backend_choice.chosen
    options_of(chosen)  # measured before the cascade, whose candidates are built with them
    options: dict[str, Any] = {}
    if isinstance(workload, DecodeBatchShape):
        cascade_timed = choose_cascade(
            chosen, options_of(chosen), device, shapes, workload, build, measure
        )
        if cascade_timed:
            tuned.extend(choice for _, choice in cascade_timed)
            options["cascade"] = cascade_policy(cascade_timed)
    backend = build(chosen, **options)
    routing: list[MeasuredChoice] = []
    if prefill_step is not None:
        prefill_choice = choose_backend(prefill_step)
        routing.append(prefill_choice)
        prefill_backend = prefill_choice.chosen
        prefill_options = options_of(prefill_backend, prefill_step)
        if prefill_backend != chosen or prefill_options != options_of(chosen):
            backend = StepRoutedBackend(
                decode=backend, prefill=build(prefill_backend, prefill_step)
            )
    # After the prefill step's: its bf16 kernel choice joins `tuned`.
    choices = [backend_choice, *tuned, *routing]
    sole = ChoiceSource.ONLY_CANDIDATE
    return SelectedBackend(backend, tuple(c for c in choices if c.source is not sole))


def _choose_sdpa_prefill(
    device: torch.device,
    shapes: AttentionShapes,
    workload: Workload,
    measure: Measure,
) -> MeasuredChoice | None:
    """SDPA or blocked matmuls for torch_sdpa's long causal prefills, on a CPU; None where the
    choice never applies (bidirectional, every layer soft-capped, or sequences too short)."""
    if device.type != "cpu" or (isinstance(workload, PackedBinShape) and not workload.causal):
        return None
    applicable = [spec for spec in shapes.distinct_specs if spec.logit_softcap is None]
    num_tokens = min(PREFILL_TIMED_TOKENS, shapes.max_model_len)
    if not applicable or num_tokens < MIN_KEYS:
        return None
    prefill = PackedBinShape(1, num_tokens, causal=True)
    spec = replace(applicable[0], sliding_window=None)  # a window past it runs blocked anyway
    return measure_option(
        measure,
        SDPA_PREFILL_PHASE,
        "torch_sdpa",
        "blocked_prefill",
        {"sdpa": False, "blocked": True},
        (replace(shapes, specs=(spec,)), prefill, device),
        PREFILL_BUDGET_S,
    )


def _choose_decode_form(
    device: torch.device,
    shapes: AttentionShapes,
    decodes: DecodeBatchShape,
    measure: Measure,
) -> MeasuredChoice | None:
    """Matmuls, SDPA or the C kernel (either form) for torch_sdpa's decodes; None where every
    layer is soft-capped (those always run as matmuls). Timed without a cascade: the cascade is
    chosen afterwards, with this option set."""
    applicable = tuple(spec for spec in shapes.distinct_specs if spec.logit_softcap is None)
    if not applicable:
        return None
    timed_shapes = replace(shapes, specs=applicable)
    forms = ["sdpa", "matmuls"]
    heads = (shapes.num_heads, shapes.num_kv_heads, shapes.head_dim)
    for form in KERNEL_FORMS:
        # Heads in lanes: a lone query head per KV head would leave seven of eight lanes idle.
        lone_heads = form == "kernel_lanes" and shapes.num_heads == shapes.num_kv_heads
        if not lone_heads and kernel_form_supported(form, device, shapes.dtype, *heads):
            forms.append(form)
    return measure_option(
        measure,
        SDPA_DECODE_PHASE,
        "torch_sdpa",
        "decode_form",
        {form: form for form in forms},
        (timed_shapes, decodes, device),
        DECODE_BUDGET_S,
        cascade=None,
    )


def _choose_bf16_kernel(
    device: torch.device,
    shapes: AttentionShapes,
    workload: Workload,
    measure: Measure,
) -> MeasuredChoice | None:
    """AVX-512 registers or AMX tiles for the cpu_kernels backend's bf16 calls; None where
    fewer than two implementations run here (the default one then runs, where it does)."""
    candidates = bf16_kernels_here(device, shapes)
    if len(candidates) < 2:
        return None
    return measure_option(
        measure,
        BF16_KERNEL_PHASE,
        "cpu_kernels",
        "bf16_kernel",
        {name: name for name in candidates},
        (shapes, workload, device),
        BF16_KERNEL_BUDGET_S,
        cascade=None,
    )
