"""`dtype="auto"` on a CPU: bfloat16 where this CPU runs bfloat16 matmuls at the model's shapes
about as fast as float32, else float32, decided by timing both once and caching the answer.

bfloat16 halves the memory of weights and KV cache, and on CPUs with AVX512-BF16 or AMX its
matmuls are also several times faster than float32. Without those instructions oneDNN widens
every bfloat16 operand to float32 as it goes: measured on an AVX2-only AMD EPYC (Zen 3), a
[512, 896] x [896, 4864] linear ran at ~10 GFLOPS in bfloat16 against ~67 in float32 on one
thread. Which case a CPU is in is found out by timing, not by reading its flags: both dtypes
run the model's largest linear layer (the MLP's up projection) at a prefill-sized row count
through the path the model itself takes (cpu_prepack.py: a prepacked oneDNN weight where
oneDNN packs that dtype here, else F.linear).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vacpack.models.cpu_prepack import packed_linear, prepack
from vacpack.tuning import MeasuredChoice, choose
from vacpack.tuning.timing import Clock

logger = logging.getLogger(__name__)

PHASE = "cpu_dtype"
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# bfloat16 stays the choice while its matmuls take at most this much longer than float32's:
# it halves the memory of weights and KV cache, which buys longer batches.
BF16_MAX_SLOWDOWN = 1.25
# Rows of the timed linear: a slice of a prefill step, where matmuls are compute-bound (at a
# decode step's few rows both dtypes are bound by memory and run alike).
TIMED_ROWS = 32
# This choice's share of the load-time budget for measured choices (vacpack.tuning).
BUDGET_S = 0.75


@dataclass(frozen=True)
class LinearShape:
    num_rows: int
    in_features: int
    out_features: int

    def key(self) -> str:
        rows, inner, out = self.num_rows, self.in_features, self.out_features
        return f"linear [{rows}, {inner}] x [{inner}, {out}]"


def timed_linear_shape(hf_config: Any) -> LinearShape | None:
    """The model's MLP up projection, from the fields every family here has; None if absent."""
    hidden_size = getattr(hf_config, "hidden_size", None)
    intermediate_size = getattr(hf_config, "intermediate_size", None)
    if not isinstance(hidden_size, int) or not isinstance(intermediate_size, int):
        return None
    return LinearShape(TIMED_ROWS, hidden_size, intermediate_size)


def linear_candidates(shape: LinearShape) -> dict[str, Callable[[], object]]:
    """One call per dtype of the linear at `shape`, as the model's layers run it."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.num_rows, shape.in_features, generator=generator)
    weight = torch.randn(shape.out_features, shape.in_features, generator=generator) * 0.02
    candidates: dict[str, Callable[[], object]] = {}
    for name, dtype in DTYPES.items():
        x_cast, weight_cast = x.to(dtype), weight.to(dtype)
        packed = prepack(weight_cast)
        if packed is not None:
            candidates[name] = functools.partial(packed_linear, x_cast, packed, None)
        else:
            candidates[name] = functools.partial(F.linear, x_cast, weight_cast)
    return candidates


def choose_cpu_dtype(
    shape: LinearShape,
    *,
    candidates: Mapping[str, Callable[[], object]] | None = None,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
) -> MeasuredChoice:
    """bfloat16 or float32 for a model whose largest linear is `shape`; `candidates` replaces
    the real matmuls (tests inject timings through it and `clock`)."""
    with torch.inference_mode():
        choice = choose(
            PHASE,
            shape.key(),
            list(DTYPES),
            (lambda: candidates) if candidates is not None else (lambda: linear_candidates(shape)),
            preferred="bfloat16",
            preferred_tolerance=BF16_MAX_SLOWDOWN,
            budget_s=BUDGET_S,
            cache_dir=cache_dir,
            clock=clock,
        )
    slowdown = choice.speed_ratio("bfloat16", "float32")
    if choice.chosen == "float32" and slowdown is not None:
        logger.warning(
            "dtype auto: float32, since bfloat16 matmuls run %.1fx slower than float32 on this "
            "CPU at the model's shapes (%s; %s); dtype='bfloat16' forces it",
            slowdown,
            shape.key(),
            choice.source.value,
        )
    return choice
