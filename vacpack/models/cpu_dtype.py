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

`dtype="bfloat16"` asked for by name keeps bfloat16 weights, but on such a CPU the arithmetic
need not be bfloat16: vacpack's C kernel (cpu_kernels/gemm_f32.c) multiplies float32 inputs by
bfloat16 weights it widens as it goes, at its float32 speed. Which arithmetic is faster here is
timed the same way (phase `cpu_bf16_arithmetic`); with float32 arithmetic the activations, norms
and KV cache are float32 and only the matrices (linear layers, vocabulary tables) stay bfloat16,
at half the memory, and the results are those of the bfloat16 weights computed in float32.
Where dtype auto runs a bfloat16 checkpoint in float32, its weights stay bfloat16 the same way
(the checkpoint's own values) unless float32 products on them are measured slower than on
float32 weights (phase `cpu_weight_dtype`).
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

from vacpack.models.cpu_prepack import can_prepack, packed_linear, prepack
from vacpack.tuning import MeasuredChoice, choose
from vacpack.tuning.timing import Clock

logger = logging.getLogger(__name__)

PHASE = "cpu_dtype"
ARITHMETIC_PHASE = "cpu_bf16_arithmetic"
WEIGHTS_PHASE = "cpu_weight_dtype"
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# bfloat16 stays the choice while its matmuls take at most this much longer than float32's:
# it halves the memory of weights and KV cache, which buys longer batches.
BF16_MAX_SLOWDOWN = 1.25
# A bfloat16 checkpoint run in float32 keeps its weights in bfloat16 while the products on them
# take at most this much longer than on float32 weights: the same values at half the memory.
BF16_WEIGHTS_MAX_SLOWDOWN = 1.1
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


def _operands(shape: LinearShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a weight for the linear at `shape`, float32."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.num_rows, shape.in_features, generator=generator)
    weight = torch.randn(shape.out_features, shape.in_features, generator=generator) * 0.02
    return x, weight


def _onednn_call(x: torch.Tensor, weight: torch.Tensor) -> Callable[[], object]:
    """x @ weight^T as the model's layers run it in their dtype (oneDNN's, prepacked where it
    packs that dtype here)."""
    packed = prepack(weight)
    if packed is not None:
        return functools.partial(packed_linear, x, packed, None)
    return functools.partial(F.linear, x, weight)


def linear_candidates(shape: LinearShape) -> dict[str, Callable[[], object]]:
    """One call per dtype of the linear at `shape`, as the model's layers run it."""
    x, weight = _operands(shape)
    return {name: _onednn_call(x.to(dtype), weight.to(dtype)) for name, dtype in DTYPES.items()}


def float32_arithmetic_runs() -> bool:
    """Whether bfloat16 weights can be multiplied in float32 here (the C kernel runs)."""
    return can_prepack(torch.empty(1, 1, dtype=torch.bfloat16), "c_gemm")


def bf16_arithmetic_candidates(shape: LinearShape) -> dict[str, Callable[[], object]]:
    """The linear at `shape` on bfloat16 weights in each arithmetic: bfloat16 (oneDNN's, as
    the model runs it) and float32 (the C kernel's; float32_arithmetic_runs must hold)."""
    x, weight = _operands(shape)
    weight = weight.to(torch.bfloat16)
    return {
        "bfloat16": _onednn_call(x.to(torch.bfloat16), weight),
        "float32": _c_kernel_call(x, weight),
    }


def weight_dtype_candidates(shape: LinearShape) -> dict[str, Callable[[], object]]:
    """The float32 linear at `shape` on weights of each dtype: bfloat16 (the C kernel's;
    float32_arithmetic_runs must hold) and float32 (oneDNN's, as float32 models run it)."""
    x, weight = _operands(shape)
    return {
        "bfloat16": _c_kernel_call(x, weight.to(torch.bfloat16)),
        "float32": _onednn_call(x, weight),
    }


def _c_kernel_call(x: torch.Tensor, weight: torch.Tensor) -> Callable[[], object]:
    packed = prepack(weight, "c_gemm")
    assert packed is not None, "the C kernel does not run here"
    return functools.partial(packed_linear, x, packed, None)


def _choose_bf16_or_float32(
    phase: str,
    shape: LinearShape,
    make_candidates: Callable[[LinearShape], Mapping[str, Callable[[], object]]],
    max_slowdown: float,
    *,
    on_c_kernel: str | None,
    forced: str | None,
    candidates: Mapping[str, Callable[[], object]] | None,
    cache_dir: Path | None,
    clock: Clock,
) -> MeasuredChoice:
    """`phase`'s choice between "bfloat16" and "float32", bfloat16 kept unless more than
    `max_slowdown` times slower; the candidate named `on_c_kernel` (its product is the C
    kernel's, on bfloat16 weights in float32) only where that kernel runs."""
    if candidates is not None:
        names = list(candidates)
    else:
        c_kernel_runs = on_c_kernel is None or float32_arithmetic_runs()
        names = [name for name in DTYPES if c_kernel_runs or name != on_c_kernel]
    with torch.inference_mode():
        return choose(
            phase,
            shape.key(),
            names,
            (lambda: candidates) if candidates is not None else (lambda: make_candidates(shape)),
            forced=forced,
            preferred="bfloat16" if "bfloat16" in names else None,
            preferred_tolerance=max_slowdown,
            budget_s=BUDGET_S,
            cache_dir=cache_dir,
            clock=clock,
        )


def choose_bf16_arithmetic(
    shape: LinearShape,
    *,
    forced: str | None = None,
    candidates: Mapping[str, Callable[[], object]] | None = None,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
) -> MeasuredChoice:
    """bfloat16 or float32 arithmetic for a bfloat16 model whose largest linear is `shape` (its
    weights stay bfloat16 either way): bfloat16 unless float32 is more than BF16_MAX_SLOWDOWN
    times faster, or `forced` (a name; float32 where the C kernel runs). `candidates` and
    `clock`: as for choose_cpu_dtype."""
    choice = _choose_bf16_or_float32(
        ARITHMETIC_PHASE,
        shape,
        bf16_arithmetic_candidates,
        BF16_MAX_SLOWDOWN,
        on_c_kernel="float32",
        forced=forced,
        candidates=candidates,
        cache_dir=cache_dir,
        clock=clock,
    )
    slowdown = choice.speed_ratio("bfloat16", "float32")
    if choice.chosen == "float32" and slowdown is not None:
        logger.info(
            "dtype bfloat16: bfloat16 weights with float32 arithmetic, %.1fx faster than "
            "bfloat16 arithmetic on this CPU at the model's shapes (%s; %s)",
            slowdown,
            shape.key(),
            choice.source.value,
        )
    return choice


def choose_weight_dtype(
    shape: LinearShape,
    *,
    candidates: Mapping[str, Callable[[], object]] | None = None,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
) -> MeasuredChoice:
    """The weights' dtype for a bfloat16 checkpoint that dtype auto runs in float32 (its
    largest linear `shape`): bfloat16, the checkpoint's own values at half the memory, unless
    the float32 products on them are more than BF16_WEIGHTS_MAX_SLOWDOWN times slower than on
    float32 weights. `candidates` and `clock`: as for choose_cpu_dtype."""
    return _choose_bf16_or_float32(
        WEIGHTS_PHASE,
        shape,
        weight_dtype_candidates,
        BF16_WEIGHTS_MAX_SLOWDOWN,
        on_c_kernel="bfloat16",
        forced=None,
        candidates=candidates,
        cache_dir=cache_dir,
        clock=clock,
    )


def choose_cpu_dtype(
    shape: LinearShape,
    *,
    candidates: Mapping[str, Callable[[], object]] | None = None,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
) -> MeasuredChoice:
    """bfloat16 or float32 for a model whose largest linear is `shape`; `candidates` replaces
    the real matmuls (tests inject timings through it and `clock`)."""
    choice = _choose_bf16_or_float32(
        PHASE,
        shape,
        linear_candidates,
        BF16_MAX_SLOWDOWN,
        on_c_kernel=None,
        forced=None,
        candidates=candidates,
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
