"""The measured choices for decodes that share a prefix: whether they run as a cascade, from which
prefix length, and how the cascade attends the shared prefix (selection.py describes each phase).

Every one is timed on the engine's decode batch behind a shared prefix: the shortest prefix the
default cascade policy cascades, then PREFIX_BAND_FACTOR times longer each (cascade_shapes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from vacpack import cpu_kernels
from vacpack.attention import timed_steps
from vacpack.attention.backend import AttentionBackend
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY, PREFIX_FORMS, CascadePolicy
from vacpack.attention.option_timing import Measure, bf16_kernels_here, measure_option
from vacpack.attention.registry import SPECS_BY_NAME
from vacpack.attention.timed_steps import AttentionShapes, DecodeBatchShape
from vacpack.tuning import MeasuredChoice

PREFIX_FORM_BUDGET_S = 0.12
CASCADE_BUDGET_S = 0.12  # per prefix length timed

CASCADE_PREFIX_PHASE = "cascade_prefix"
BF16_PREFIX_KERNEL_PHASE = "cpu_bf16_prefix_kernel"
CASCADE_PHASE = "attention_cascade"
# Own tokens of each decode after a shared prefix, at most: a prompt's own part and some output.
OWN_TOKENS_AFTER_PREFIX = 128
# The cascade is timed behind prefixes of the shortest length its policy cascades, then this
# many times longer each, up to PREFIX_BANDS lengths that fit the model's context.
PREFIX_BAND_FACTOR = 4
PREFIX_BANDS = 3


def choose_prefix_form(
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
    return measure_option(
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


def choose_prefix_bf16_kernel(
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
    return measure_option(
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


def choose_cascade(
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
                    timed_steps.timed_calls,
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
