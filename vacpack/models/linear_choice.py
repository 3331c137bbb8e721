"""Which kernel each of a CPU model's linear layers runs on, chosen by timing each on its shape.

On a CPU the linears are most of every step (over 90% of a float32 prefill on a 2-core Zen 3).
oneDNN's packed matmul is the default; vacpack's own register-blocked kernels are the other
candidates: cpu_kernels/gemm_f32.c in float32, cpu_kernels/gemm_bf16.c in bf16 on AVX512-BF16
CPUs. Which is faster depends on the CPU, the layer's shape and the row count: on the Zen 3 the
float32 C kernel wins decode-sized products by 15-40% and prefill-sized ones by 0-20% or loses
them by a few percent, shape by shape. So each distinct weight shape of the model is timed with
every kernel, as the model runs it (an encoder's up
projection with its activation; a gated MLP's gate/up projection through act(gate) * up, which
the C kernel finishes as it writes its outputs and oneDNN's product leaves to a pass of the
model's) at a prefill slice's rows and at decode batches' (as many rows
again), one call covering both so that each regime's speed weighs the same, and the faster
kernel packs the weights of that shape (phase `cpu_linear`, one choice per shape;
VACPACK_CHOICE_CPU_LINEAR=onednn|c_gemm|c_gemm_bf16 forces one). Each weight is packed once,
for its kernel: never held twice.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vacpack.cpu_kernels.gemm import GemmWeight
from vacpack.host_memory import largest_cpu_cache_bytes
from vacpack.models.activations import ONEDNN_POST_OPS, act_and_mul
from vacpack.models.cpu_prepack import (
    LinearKernel,
    PackedWeight,
    can_prepack,
    copy_packed,
    kernel_gate,
    packed_linear,
    prepack,
)
from vacpack.tuning import ChoiceSource, MeasuredChoice, choose
from vacpack.tuning.timing import Clock

PHASE = "cpu_linear"
# oneDNN stays unless the C kernel is this much faster: torch's own kernel is the one more
# users have run.
C_GEMM_MIN_SPEEDUP = 1.02
# A slice of a prefill bin's rows, and a decode step's (the scheduler's default batch). At 128
# rows both kernels run within a few percent of their speed at 2,048 (compute-bound).
PREFILL_ROWS = 128
DECODE_ROWS = 64
# An encoder's rows: a corpus bin's thousands of tokens, where the bf16 C kernel falls behind
# oneDNN by a few percent on MiniLM's shapes that it leads at 128 rows (q/k/v level at 128
# rows and 0.90x at 4,096 on the 2-core Zen 4; attention output and down projection 1.05x at
# 128, 0.98-1.0x at 1,024): timed at 128, those shapes flipped between loads.
ENCODER_ROWS = 1024
# Decode steps timed per prefill slice: as many rows in decode-sized calls as in the prefill
# slice, so that each regime's speed weighs the same in the sum. Weighted by G1's tokens
# instead (one 64-row step per 256-row slice), a kernel 20% slower at decodes hid behind a tie
# at prefill: on the Zen 3 oneDNN kept the MLP's shapes within the 2% preference below, and
# every decode step ran its gate/up projection at 10.3 ms against the C kernel's 8.4.
DECODE_STEPS_PER_PREFILL_SLICE = PREFILL_ROWS // DECODE_ROWS
# A weight wider than this is timed on a slice of its output features this big: both kernels
# split the outputs into the same independent panels, so a slice far past the caches times the
# per-column cost of the whole. An LM head of 151,936 x 896 float32 weights (544 MB) took 1.7 s
# of packing and warm-up at a first load, with no timed round left in its budget.
TIMED_WEIGHT_BYTES = 64 << 20
# A model reads each linear's weight once a step, every other layer's weights in between: from
# memory, not from a cache. Timed on one copy, a weight stays in the last-level cache after the
# first call, and the kernel that prefetches its weights (the C kernel) loses the lead it has in
# the model: on the 2-core Zen 3 (32 MiB L3) its [1,152 x 896] q/k/v projection at 64 rows ran
# 8% faster than oneDNN's on a cached weight, 29% on a weight from memory, so the 2% preference
# below and a little noise kept oneDNN there and for the attention output. So each timed product
# reads the next of enough copies of the weight to fill the largest cache twice over (at most
# MAX_WEIGHT_COPIES: the weights that need more are small enough to stay in a cache between
# steps in the model too).
COLD_CACHE_MULTIPLE = 2
DEFAULT_CACHE_BYTES = 32 << 20  # where the system does not say
MAX_WEIGHT_COPIES = 32
# Each weight shape's share of a load's 2 s timing allowance (vacpack.tuning); a model has four
# or five (attention in and out, MLP in and out, LM head), and the attention phases timed after
# them need about 1 s. At 0.25 s the MLP's shapes time two rounds or more on a 2-core Zen 3
# (at 0.2 s the gate/up projection got one, and a burst of noise decided it).
BUDGET_S = 0.25


@dataclass(frozen=True)
class LinearTiming:
    """The layer a linear kernel is timed on, and at which row counts."""

    in_features: int
    out_features: int
    dtype: torch.dtype
    row_counts: tuple[int, ...]
    activation: str | None = None  # applied by the matmul, as the model's layer does
    # A gated MLP's [gate; up] projection, of which the layer returns gated_by(gate) * up (an
    # activation the C kernel applies): the C kernel finishes that as it writes its outputs,
    # after oneDNN's product a pass does.
    gated_by: str | None = None
    # The weights' dtype where it is not `dtype`, that of the inputs, outputs and arithmetic
    # (bfloat16 weights, float32 arithmetic: models/cpu_dtype.py).
    weight_dtype: torch.dtype | None = None

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype the weights are kept in."""
        return self.weight_dtype or self.dtype

    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.stored_dtype != self.dtype:
            dtype += f" on {str(self.stored_dtype).removeprefix('torch.')} weights"
        rows = " + ".join(str(n) for n in self.row_counts)
        inner, out = self.in_features, self.out_features
        activation = f" then {self.activation}" if self.activation else ""
        if self.gated_by:
            activation += f" then {self.gated_by}(gate) * up"
        return f"[{rows} rows, {inner}] x [{inner}, {out}]{activation} {dtype}, weights from memory"


# What a gated MLP does with a [gate | up] product the matmul did not finish (the model's own
# pass: its measured SiLU-and-multiply op for SiLU, PyTorch's activation otherwise).
GatePass = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelLinears:
    """What a model's linear layers are timed at, besides each weight's shape."""

    dtype: torch.dtype
    gated_mlp: bool  # decoder layers: timed at prefill and decode rows; else prefill rows
    # An encoder's up projection ([out, in]) and the activation its matmul applies.
    activation_shape: tuple[int, int] | None = None
    activation: str | None = None
    # The model's SiLU-and-multiply op (its measured layer op), for timing a gated projection
    # oneDNN leaves unfinished; PyTorch's where None.
    silu_and_mul: GatePass | None = None
    weight_dtype: torch.dtype | None = None  # where not `dtype` (see LinearTiming)

    @classmethod
    def from_hf(
        cls,
        hf_config: Any,
        dtype: torch.dtype,
        gated_mlp: bool,
        silu_and_mul: GatePass | None = None,
        weight_dtype: torch.dtype | None = None,
    ) -> ModelLinears:
        hidden_size = getattr(hf_config, "hidden_size", None)
        intermediate_size = getattr(hf_config, "intermediate_size", None)
        activation = getattr(hf_config, "hidden_act", None)
        sizes_known = isinstance(hidden_size, int) and isinstance(intermediate_size, int)
        if gated_mlp or activation not in ONEDNN_POST_OPS or not sizes_known:
            return cls(dtype, gated_mlp, silu_and_mul=silu_and_mul, weight_dtype=weight_dtype)
        assert isinstance(hidden_size, int) and isinstance(intermediate_size, int)
        activation_shape = (intermediate_size, hidden_size)
        return cls(
            dtype, gated_mlp, activation_shape, activation, silu_and_mul, weight_dtype=weight_dtype
        )

    def timing(
        self, out_features: int, in_features: int, vocabulary: bool, gated_by: str | None = None
    ) -> LinearTiming:
        """The timing of a weight [out_features, in_features]; `vocabulary`: the LM head, which
        a generation step runs on its decode rows only; `gated_by`: a gated MLP's gate/up
        projection and its activation."""
        if vocabulary:
            rows: tuple[int, ...] = (DECODE_ROWS,)
        elif self.gated_mlp:
            rows = (PREFILL_ROWS, *[DECODE_ROWS] * DECODE_STEPS_PER_PREFILL_SLICE)
        else:
            rows = (ENCODER_ROWS,)
        activated = (out_features, in_features) == self.activation_shape
        activation = self.activation if activated and not vocabulary else None
        return LinearTiming(
            in_features, out_features, self.dtype, rows, activation, gated_by, self.weight_dtype
        )

    def gate_pass(self, activation: str) -> GatePass:
        """The pass the model runs on an unfinished [gate | up] product of `activation`."""
        if activation == "silu" and self.silu_and_mul is not None:
            return self.silu_and_mul
        return functools.partial(act_and_mul, activation=activation)


def eligible_linear_kernels(
    device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype | None = None
) -> list[LinearKernel]:
    """The kernels that run `dtype` linears on `weight_dtype` weights (default: `dtype`) here,
    oneDNN (or F.linear) first. The float32 C kernel's arithmetic is float32, on float32 or
    bfloat16 weights; the bf16 one's bf16, on bf16 weights (AVX512-BF16 CPUs); oneDNN's is the
    weights' dtype."""
    if device.type != "cpu":
        return []
    weight_dtype = weight_dtype or dtype
    weights = torch.empty(1, 1, dtype=weight_dtype)
    kernels: list[LinearKernel] = ["onednn"] if weight_dtype == dtype else []
    if dtype == torch.float32 and can_prepack(weights, "c_gemm"):
        kernels.append("c_gemm")
    if dtype == weight_dtype == torch.bfloat16 and can_prepack(weights, "c_gemm_bf16"):
        kernels.append("c_gemm_bf16")
    return kernels


def timed_out_features(timing: LinearTiming) -> int:
    """The output features a weight is timed on: all, or a slice of TIMED_WEIGHT_BYTES (a
    whole number of the C kernel's 16-column panels)."""
    element_bytes = torch.empty((), dtype=timing.stored_dtype).element_size()
    columns = -(-TIMED_WEIGHT_BYTES // (timing.in_features * element_bytes))
    return min(timing.out_features, -(-columns // 16) * 16)


def timed_weight_copies(timing: LinearTiming, cache_bytes: int | None = None) -> int:
    """How many copies of the timed weight its products rotate through, so that each reads its
    weight from memory as the model does (see COLD_CACHE_MULTIPLE)."""
    if cache_bytes is None:
        cache_bytes = largest_cpu_cache_bytes() or DEFAULT_CACHE_BYTES
    element_bytes = torch.empty((), dtype=timing.stored_dtype).element_size()
    weight_bytes = timed_out_features(timing) * timing.in_features * element_bytes
    return min(MAX_WEIGHT_COPIES, -(-COLD_CACHE_MULTIPLE * cache_bytes // weight_bytes))


def linear_calls(
    timing: LinearTiming,
    kernels: list[LinearKernel],
    num_copies: int | None = None,
    gate_pass: GatePass | None = None,
) -> dict[str, Callable[[], object]]:
    """One call per kernel: the timed layer at each of the row counts, on the same inputs, each
    product on the next of `num_copies` copies of the weight (timed_weight_copies by default).
    A gated projection ends in gated_by(gate) * up: the C kernel's own, else `gate_pass`
    (PyTorch's by default) after the product."""
    generator = torch.Generator().manual_seed(0)
    out_features = timed_out_features(timing)
    # Random rows repeated: a timing does not depend on the values, and drawing 64 MiB of
    # normals one at a time cost 0.1 s a weight.
    block = torch.randn(min(out_features, 256), timing.in_features, generator=generator) * 0.02
    weight = block.to(timing.stored_dtype).repeat(-(-out_features // block.shape[0]), 1)[
        :out_features
    ]
    bias = torch.zeros(out_features, dtype=timing.dtype) if timing.activation else None
    inputs = [
        torch.randn(rows, timing.in_features, generator=generator).to(timing.dtype)
        for rows in timing.row_counts
    ]
    if num_copies is None:
        num_copies = timed_weight_copies(timing)
    gated_by = timing.gated_by
    if gated_by is not None and gate_pass is None:
        gate_pass = functools.partial(act_and_mul, activation=gated_by)

    def run(weights: Iterator[tuple[torch.Tensor, PackedWeight | None]]) -> None:
        for x in inputs:
            plain, packed = next(weights)
            if packed is None:
                out = torch.nn.functional.linear(x, plain, bias)
            else:
                out = packed_linear(x, packed, bias, timing.activation)
            if gate_pass is not None and not _gates_itself(packed):
                gate_pass(out)

    def rotation(kernel: LinearKernel) -> Iterator[tuple[torch.Tensor, PackedWeight | None]]:
        # Packed once and the packed weight copied: packing each copy cost 3x the time.
        packed = prepack(weight, kernel, kernel_gate(kernel, gated_by))
        copies: list[tuple[torch.Tensor, PackedWeight | None]]
        if packed is None:
            copies = [(weight.clone(), None) for _ in range(num_copies)]
        else:
            copies = [(weight, copy_packed(packed)) for _ in range(num_copies - 1)]
            copies.append((weight, packed))
        return itertools.cycle(copies)

    return {kernel: functools.partial(run, rotation(kernel)) for kernel in kernels}


def _gates_itself(packed: PackedWeight | None) -> bool:
    return isinstance(packed, GemmWeight) and packed.gated_by is not None


def choose_linear_kernel(
    device: torch.device,
    timing: LinearTiming,
    *,
    candidates: Mapping[str, Callable[[], object]] | None = None,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
    gate_pass: GatePass | None = None,
) -> tuple[LinearKernel, MeasuredChoice | None]:
    """The kernel to pack weights of `timing`'s shape for, and the choice that picked it (None
    where no kernel or only one runs here). `candidates` replaces the real
    matmuls (tests inject timings through it and `clock`); `gate_pass`: see linear_calls."""
    kernels = eligible_linear_kernels(device, timing.dtype, timing.weight_dtype)
    if not kernels:
        return "onednn", None
    with torch.inference_mode():
        choice = choose(
            PHASE,
            timing.key(),
            list(kernels),
            (lambda: candidates)
            if candidates is not None
            else functools.partial(linear_calls, timing, kernels, gate_pass=gate_pass),
            preferred="onednn" if "onednn" in kernels else None,
            preferred_tolerance=C_GEMM_MIN_SPEEDUP,
            budget_s=BUDGET_S,
            cache_dir=cache_dir,
            clock=clock,
        )
    chosen = next(kernel for kernel in kernels if kernel == choice.chosen)
    return chosen, None if choice.source is ChoiceSource.ONLY_CANDIDATE else choice


class LinearKernelChooser:
    """Each weight shape's kernel, chosen when the loader first asks for it (timed, or read from
    the cache); `choices` holds the measurements, in the order the shapes came."""

    def __init__(
        self, device: torch.device, linears: ModelLinears, cache_dir: Path | None = None
    ) -> None:
        self.device = device
        self.linears = linears
        self.cache_dir = cache_dir
        self.choices: list[MeasuredChoice] = []
        self._kernels: dict[tuple[int, int, bool, str | None], LinearKernel] = {}

    def __call__(
        self, out_features: int, in_features: int, vocabulary: bool, gated_by: str | None = None
    ) -> LinearKernel:
        shape = (out_features, in_features, vocabulary, gated_by)
        if shape not in self._kernels:
            timing = self.linears.timing(out_features, in_features, vocabulary, gated_by)
            gate_pass = self.linears.gate_pass(gated_by) if gated_by else None
            kernel, choice = choose_linear_kernel(
                self.device, timing, cache_dir=self.cache_dir, gate_pass=gate_pass
            )
            self._kernels[shape] = kernel
            if choice is not None:
                self.choices.append(choice)
        return self._kernels[shape]
