"""Timing a backend's options: the backend built with each candidate value, timed on one layer
of each kind of the model's own shapes over a workload (timed_steps.py), through
vacpack.tuning (interleaved rounds, best of, cached on disk). selection.py and
cascade_selection.py measure their options through this."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from vacpack import cpu_kernels
from vacpack.attention import timed_steps
from vacpack.attention.registry import create_backend
from vacpack.attention.timed_steps import AttentionShapes, Workload
from vacpack.tuning import MeasuredChoice

Measure = Callable[..., MeasuredChoice]  # vacpack.tuning.choose, with the cache and clock bound


def measure_option(
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
        lambda: timed_steps.timed_calls(
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


def bf16_kernels_here(device: torch.device, shapes: AttentionShapes) -> list[str]:
    """The implementations of the C kernel's bf16 attention that run this model here."""
    if device.type != "cpu" or shapes.dtype != torch.bfloat16:
        return []
    return [
        name
        for name in cpu_kernels.BF16_KERNELS
        if cpu_kernels.varlen_attention_supported(device, shapes.dtype, shapes.head_dim, name)
    ]
