"""Each elementwise op of a model's layers from the implementation measured fastest for it.

Where fused kernels run (the C kernels: bf16 on a CPU with AVX512-BF16, float32 on any CPU
with a C compiler; the Triton kernels: on a GPU), each op the model's layers call (a decoder's
RMSNorm, residual add with RMSNorm, SiLU(gate) * up and rotary embeddings; an encoder's
residual add with LayerNorm) is timed against its PyTorch twin on the model's own shapes, a
slice of a prefill's rows as the MLP runs them, through vacpack.tuning (phase layer_op_<op>;
VACPACK_CHOICE_LAYER_OP_<OP> forces one). A fused pass saves memory traffic, but PyTorch's
vectorised ops may still win on a CPU whose kernels were not tuned for it; where only PyTorch's
ops run an op, it is not timed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vacpack.models.layer_ops import (
    CPU_MLP_ROWS_PER_PASS,
    DECODER_LAYER_OPS,
    LayerOps,
    PerOpLayerOps,
    eligible_layer_ops,
)
from vacpack.tuning import ChoiceSource, MeasuredChoice, choose
from vacpack.tuning.timing import Clock


def layer_op_phase(op: str) -> str:
    """The tuning phase of an op's choice."""
    return f"layer_op_{op}"


# A decoder's layer-op phases, in the order its load times them.
DECODER_LAYER_OP_PHASES = tuple(layer_op_phase(op) for op in DECODER_LAYER_OPS)
# Each op's share of the load-time budget for measured choices: these ops are short.
BUDGET_S = 0.06
RMS_NORM_EPS = 1e-6
LAYER_NORM_EPS = 1e-12


@dataclass(frozen=True)
class LayerShapes:
    """The widths the elementwise ops of one layer run at."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_rows: int = CPU_MLP_ROWS_PER_PASS

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: torch.dtype) -> LayerShapes | None:
        """From the fields every family here has; None where one is missing."""
        hidden_size = getattr(hf_config, "hidden_size", None)
        intermediate_size = getattr(hf_config, "intermediate_size", None)
        num_heads = getattr(hf_config, "num_attention_heads", None)
        if not (
            isinstance(hidden_size, int)
            and isinstance(intermediate_size, int)
            and isinstance(num_heads, int)
        ):
            return None
        return cls(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hidden_size // num_heads,
            dtype=dtype,
        )

    def key(self, op: str) -> str:
        rows, dtype = self.num_rows, str(self.dtype).removeprefix("torch.")
        if op == "silu_and_mul":
            return f"[{rows}, 2 x {self.intermediate_size}] {dtype}"
        if op == "rotary_qk":
            heads = f"{self.num_heads} + {self.num_kv_heads} heads of {self.head_dim}"
            return f"{rows} tokens, {heads} {dtype}"
        return f"[{rows}, {self.hidden_size}] {dtype}"


def op_calls(
    op: str, implementations: dict[str, LayerOps], shapes: LayerShapes, device: torch.device
) -> dict[str, Callable[[], object]]:
    """One call per implementation running `op` on the same inputs, laid out as the model's
    layers hold them (q and k are views into one fused projection's rows)."""
    rows, dtype = shapes.num_rows, shapes.dtype

    def uniform(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).uniform_(-1.0, 1.0)

    args: tuple[Any, ...]
    if op == "add_layer_norm":
        hidden = shapes.hidden_size
        x, residual = uniform(rows, hidden), uniform(rows, hidden)
        args = (x, residual, uniform(hidden), uniform(hidden), LAYER_NORM_EPS)
    elif op in ("rms_norm", "add_rms_norm"):
        x, weight = uniform(rows, shapes.hidden_size), uniform(shapes.hidden_size)
        args = (x, weight, RMS_NORM_EPS)
        if op == "add_rms_norm":
            args = (x, uniform(rows, shapes.hidden_size), weight, RMS_NORM_EPS)
    elif op == "silu_and_mul":
        args = (uniform(rows, 2 * shapes.intermediate_size),)
    else:
        heads, kv_heads, dim = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
        q, k, _ = uniform(rows, (heads + 2 * kv_heads) * dim).split(
            [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1
        )
        cos, sin = uniform(rows, dim).unsqueeze(1).chunk(2, dim=-1)
        args = (q.view(rows, heads, dim), k.view(rows, kv_heads, dim), (cos, sin))
    return {
        name: functools.partial(getattr(implementation, op), *args)
        for name, implementation in implementations.items()
    }


def choose_layer_ops(
    device: torch.device,
    shapes: LayerShapes | None,
    dtype: torch.dtype,
    ops_used: tuple[str, ...] = DECODER_LAYER_OPS,
    *,
    cache_dir: Path | None = None,
    clock: Clock = time.perf_counter,
) -> tuple[LayerOps, tuple[MeasuredChoice, ...]]:
    """The ops a model whose layers call `ops_used` is built with, and the choices that made
    them (none where a single implementation runs here, or the model's shapes are unknown: then
    the preferred one). An implementation that would run an op on PyTorch's ops anyway (a
    kernel missing in this dtype) is no candidate for it."""
    implementations = eligible_layer_ops(device, dtype)
    preferred = next(iter(implementations.values()))
    if shapes is None or not ops_used:
        return preferred, ()
    choices = []
    with torch.inference_mode():
        for op in ops_used:
            candidates = {
                name: ops for name, ops in implementations.items() if ops.implements(op, dtype)
            }
            choices.append(
                choose(
                    layer_op_phase(op),
                    shapes.key(op),
                    list(candidates),
                    functools.partial(op_calls, op, candidates, shapes, device),
                    budget_s=BUDGET_S,
                    cache_dir=cache_dir,
                    clock=clock,
                )
            )
    chosen = {op: implementations[c.chosen] for op, c in zip(ops_used, choices, strict=True)}
    names = {ops.name for ops in chosen.values()}
    ops = (
        implementations[names.pop()]
        if len(names) == 1
        else PerOpLayerOps(preferred.mlp_rows_per_pass, chosen)
    )
    return ops, tuple(c for c in choices if c.source is not ChoiceSource.ONLY_CANDIDATE)
