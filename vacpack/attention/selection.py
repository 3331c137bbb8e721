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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vacpack import cpu_kernels
from vacpack.attention.backend import AttentionBackend
from vacpack.attention.blocked_prefill import MIN_KEYS
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY, PREFIX_FORMS, CascadePolicy
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
    timed_calls,
)
from vacpack.tuning import ChoiceSource, MeasuredChoice, choose
from vacpack.tuning.timing import Clock

Measure = Callable[..., MeasuredChoice]  # vacpack.tuning.choose, with the cache and clock bound

# Each choice's share of the ~2 s that a first load may spend timing (the dtype takes 0.75 s).
BACKEND_BUDGET_S = 0.3
PREFILL_BUDGET_S = 0.25
DECODE_BUDGET_S = 0.25
PREFIX_FORM_BUDGET_S = 0.12
BF16_KERNEL_BUDGET_S = 0.2
CASCADE_BUDGET_S = 0.12  # per prefix length timed

SDPA_PREFILL_PHASE = "sdpa_prefill"
SDPA_DECODE_PHASE = "sdpa_decode"
CASCADE_PREFIX_PHASE = "cascade_prefix"
BF16_KERNEL_PHASE = "cpu_bf16_kernel"
BF16_PREFIX_KERNEL_PHASE = "cpu_bf16_prefix_kernel"
CASCADE_PHASE = "attention_cascade"
# The prefill timed for sdpa_prefill: long enough to be past MIN_KEYS, where the choice applies,
# short enough that a slow candidate's one call stays within the budget.
PREFILL_TIMED_TOKENS = 512
# Own tokens of each decode after a shared prefix, at most: a prompt's own part and some output.
OWN_TOKENS_AFTER_PREFIX = 128
# The cascade is timed behind prefixes of the shortest length its policy cascades, then this
# many times longer each, up to PREFIX_BANDS lengths that fit the model's context.
PREFIX_BAND_FACTOR = 4
PREFIX_BANDS = 3


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
            prefix_kernel = _choose_prefix_bf16_kernel(
                device, shapes, workload, dict(options_list), measure
            )
            if prefix_kernel is not None:
                tuned.append(prefix_kernel)
                options_list.append(("prefix_bf16_kernel", prefix_kernel.chosen))
        if "prefix_form" in declared and isinstance(workload, DecodeBatchShape):
            prefix_form = _choose_prefix_form(device, shapes, workload, dict(options_list), measure)
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
            return timed_calls(factories, shapes, timed, device)

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
        cascade_timed = _choose_cascade(
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


def _measure_option(
    measure: Measure,
    phase: str,
    backend_name: str,
    option: str,
    values: dict[str, Any],
    timed: tuple[AttentionShapes, Workload, torch.device],
    budget_s: float,
    **fixed: Any,
) -> MeasuredChoice:
    """One option of a backend, measured: the backend built with each candidate's value of
    `option` (and the `fixed` options), timed on one layer of each kind of `timed`'s shapes
    over its workload."""
    shapes, workload, device = timed
    return measure(
        phase,
        f"{shapes.key()}; {workload.key()}",
        list(values),
        lambda: timed_calls(
            {
                name: functools.partial(create_backend, backend_name, **fixed, **{option: value})
                for name, value in values.items()
            },
            shapes,
            workload,
            device,
        ),
        budget_s=budget_s,
    )


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
    return _measure_option(
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
    return _measure_option(
        measure,
        SDPA_DECODE_PHASE,
        "torch_sdpa",
        "decode_form",
        {form: form for form in forms},
        (timed_shapes, decodes, device),
        DECODE_BUDGET_S,
        cascade=None,
    )


def bf16_kernels_here(device: torch.device, shapes: AttentionShapes) -> list[str]:
    """The implementations of the C kernel's bf16 attention that run this model here."""
    if device.type != "cpu" or shapes.dtype != torch.bfloat16:
        return []
    return [
        name
        for name in cpu_kernels.BF16_KERNELS
        if cpu_kernels.varlen_attention_supported(device, shapes.dtype, shapes.head_dim, name)
    ]


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
    return _measure_option(
        measure,
        BF16_KERNEL_PHASE,
        "cpu_kernels",
        "bf16_kernel",
        {name: name for name in candidates},
        (shapes, workload, device),
        BF16_KERNEL_BUDGET_S,
        cascade=None,
    )


def _choose_prefix_form(
    device: torch.device,
    shapes: AttentionShapes,
    decodes: DecodeBatchShape,
    options: dict[str, Any],
    measure: Measure,
) -> MeasuredChoice | None:
    """Matmuls or the C varlen kernel for torch_sdpa's cascade prefixes (built with the
    backend's `options` measured so far), timed behind the longest prefix the cascade is timed
    at; None where the kernel cannot run them (a GPU, the model's dtype or head size, no
    full-attention layer without a soft cap) or no cascade is timed."""
    timing = _prefix_timing(shapes, decodes)
    if (
        device.type != "cpu"
        or timing is None
        or not cpu_kernels.varlen_attention_supported(device, shapes.dtype, shapes.head_dim)
    ):
        return None
    timed_shapes, shared = timing
    return _measure_option(
        measure,
        CASCADE_PREFIX_PHASE,
        "torch_sdpa",
        "prefix_form",
        {form: form for form in PREFIX_FORMS},
        (timed_shapes, shared, device),
        PREFIX_FORM_BUDGET_S,
        **options,
        cascade=DEFAULT_CASCADE_POLICY,
    )


def _prefix_timing(
    shapes: AttentionShapes, decodes: DecodeBatchShape
) -> tuple[AttentionShapes, DecodeBatchShape] | None:
    """What a cascade's prefix form is timed on: the model's full-attention layers without a
    soft cap (those a cascade runs), behind the longest prefix the cascade is timed at; None
    where there is no such layer or no prefix fits the context."""
    full_layers = tuple(
        spec
        for spec in shapes.distinct_specs
        if spec.sliding_window is None and spec.logit_softcap is None
    )
    bands = cascade_shapes(decodes, shapes.max_model_len)
    if not full_layers or not bands:
        return None
    return replace(shapes, specs=full_layers), bands[-1]


def _choose_prefix_bf16_kernel(
    device: torch.device,
    shapes: AttentionShapes,
    decodes: DecodeBatchShape,
    options: dict[str, Any],
    measure: Measure,
) -> MeasuredChoice | None:
    """AVX-512 registers or AMX tiles for the cpu_kernels backend's cascade prefixes (every
    decode sharing a prefix attends to it in one call: many rows over the same keys, where
    tiles may win though they lose the decodes' own pages), built with the backend's `options`
    measured so far; None where fewer than two implementations run or no cascade is timed."""
    candidates = bf16_kernels_here(device, shapes)
    timing = _prefix_timing(shapes, decodes)
    if len(candidates) < 2 or timing is None:
        return None
    timed_shapes, shared = timing
    return _measure_option(
        measure,
        BF16_PREFIX_KERNEL_PHASE,
        "cpu_kernels",
        "prefix_bf16_kernel",
        {name: name for name in candidates},
        (timed_shapes, shared, device),
        PREFIX_FORM_BUDGET_S,
        **options,
        cascade=DEFAULT_CASCADE_POLICY,
    )


def cascade_shapes(decodes: DecodeBatchShape, max_model_len: int) -> list[DecodeBatchShape]:
    """The engine's decode batch behind the shortest shared prefix the default cascade policy
    runs as a cascade for that many decodes, then behind prefixes PREFIX_BAND_FACTOR times
    longer each: at most PREFIX_BANDS of them, those that fit the model's context."""
    policy = DEFAULT_CASCADE_POLICY
    if decodes.num_seqs < 2:
        return []
    page_size = decodes.page_size
    saved_per_seq = -(-policy.min_saved_tokens // (decodes.num_seqs - 1))
    prefix_tokens = max(policy.min_prefix_tokens, saved_per_seq)
    prefix_tokens = -(-prefix_tokens // page_size) * page_size
    own_tokens = min(decodes.longest_context, OWN_TOKENS_AFTER_PREFIX)
    shapes = []
    for band in range(PREFIX_BANDS):
        prefix_band = prefix_tokens * PREFIX_BAND_FACTOR**band
        if prefix_band + own_tokens > max_model_len:
            break
        shapes.append(DecodeBatchShape(decodes.num_seqs, own_tokens, page_size, prefix_band))
    return shapes


def cascade_policy(timed: list[tuple[int, MeasuredChoice]]) -> CascadePolicy | None:
    """The cascade policy that the choices timed behind prefixes of increasing length (prefix
    tokens, choice) call for: cascade from the shortest prefix from which the cascade won at
    every longer one too; None where it lost at the longest."""
    won_from = None
    for band, (prefix_tokens, choice) in reversed(list(enumerate(timed))):
        if choice.chosen != "cascade":
            break
        won_from = band, prefix_tokens
    if won_from is None:
        return None
    band, prefix_tokens = won_from
    if band == 0:  # won wherever the default policy cascades
        return DEFAULT_CASCADE_POLICY
    return replace(DEFAULT_CASCADE_POLICY, min_prefix_tokens=prefix_tokens)


def _choose_cascade(
    backend_name: str,
    backend_options: tuple[tuple[str, Any], ...],
    device: torch.device,
    shapes: AttentionShapes,
    decodes: DecodeBatchShape,
    build: Callable[..., AttentionBackend],
    measure: Measure,
) -> list[tuple[int, MeasuredChoice]]:
    """Cascade or not behind each timed prefix length, shortest first, as (prefix tokens,
    choice), where the backend takes the option and the model's full-attention layers could run
    one (a windowed layer never cascades); empty where no cascade is possible. The backend's
    measured options are part of each choice's key: a cascade timed with other decode or prefix
    forms is another measurement."""
    if "cascade" not in SPECS_BY_NAME[backend_name].options:
        return []
    full_layers = tuple(s for s in shapes.distinct_specs if s.sliding_window is None)
    if not full_layers:
        return []
    timed_shapes = replace(shapes, specs=full_layers)
    policies = {"cascade": DEFAULT_CASCADE_POLICY, "no_cascade": None}
    return [
        (
            shared.shared_prefix_tokens,
            measure(
                CASCADE_PHASE,
                f"{backend_name}{_describe_options(backend_options)}; {timed_shapes.key()}; "
                f"{shared.key()}",
                list(policies),
                functools.partial(
                    timed_calls,
                    {
                        option: functools.partial(build, backend_name, cascade=policy)
                        for option, policy in policies.items()
                    },
                    timed_shapes,
                    shared,
                    device,
                ),
                budget_s=CASCADE_BUDGET_S,
            ),
        )
        for shared in cascade_shapes(decodes, shapes.max_model_len)
    ]


def _describe_options(options: tuple[tuple[str, Any], ...]) -> str:
    """A backend's measured options as text for a choice's key: " (decode_form kernel,
    prefix_form kernel)", or "" for none."""
    return f" ({', '.join(f'{name} {value}' for name, value in options)})" if options else ""
