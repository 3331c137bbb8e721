"""Linear-layer weights reordered once for the CPU's matmul kernel: oneDNN's blocked layout, or
the panels of vacpack's own kernels (cpu_kernels/gemm_f32.c for float32 products,
cpu_kernels/gemm_bf16.c for bf16 ones) where they measured faster.

`F.linear` on a CPU hands oneDNN a plain [out, in] weight, and oneDNN reorders it into the
blocked (for bf16 on AMX: VNNI-packed) layout its kernels read, on every call. For a prefill
step the reorder is a few percent of the matmul; for a decode step, where a handful of rows
meet the whole weight, it is most of it. Reordering once at load time, as torch.compile's
CPU freezing pass does, and calling oneDNN's linear on the packed weight removes it. Measured
on a 2-core bf16 CPU (Qwen2.5-0.5B shapes): the [9728, 896] gate/up projection 0.63 -> 0.21 ms
for one row, 2.3 -> 1.7 ms for 64 rows, 11.6 -> 10.8 ms for 512; the same numbers bit for bit.

The packed weight is opaque (oneDNN's has no strides, no storage): it serves the matmul and
nothing else, so a layer that packs its weight keeps only the packed copy, unless its plain
table is still read elsewhere (a tied embedding). Which kernel packs a model's weights is a
measured choice made before loading (linear_choice.py): one layout per model, never two copies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Literal, TypeAlias

import torch

from vacpack.cpu_kernels.gemm import (
    GemmWeight,
    applies_activation,
    gates,
    gemm_linear,
    gemm_supported,
    pack_weight,
)
from vacpack.models.activations import ACTIVATIONS, ONEDNN_POST_OPS

logger = logging.getLogger(__name__)

# Rows the packed layout is tuned for: oneDNN picks blocking from it, and every row count still
# runs. Against no hint, 512 measured as fast or faster from 1 to 2,048 rows (1.3x at 7 rows,
# 4% at 2,048); a hint equal to the rows was within a few percent of it at 64, 512 and 2,048.
PACK_FOR_ROWS = 512
# Setting this to 0 keeps plain weights and F.linear: a switch for comparisons and debugging.
DISABLE_ENV = "VACPACK_CPU_PREPACK"

# The kernels a CPU linear can run on: oneDNN (torch's), gemm_f32.c (float32 arithmetic) or
# gemm_bf16.c (bf16 arithmetic, AVX512-BF16 CPUs).
LinearKernel: TypeAlias = Literal["onednn", "c_gemm", "c_gemm_bf16"]
# The C kernels, by the arithmetic they run.
C_KERNEL_ARITHMETIC: dict[str, torch.dtype] = {
    "c_gemm": torch.float32,
    "c_gemm_bf16": torch.bfloat16,
}
# A oneDNN-packed tensor, or the C kernel's panels.
PackedWeight: TypeAlias = torch.Tensor | GemmWeight


def can_prepack(weight: torch.Tensor, kernel: LinearKernel = "onednn") -> bool:
    """Whether `weight` is a CPU tensor `kernel` can pack on this machine."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or weight.device.type != "cpu":
        return False
    if kernel in C_KERNEL_ARITHMETIC:
        return gemm_supported(weight.dtype, C_KERNEL_ARITHMETIC[kernel])
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def prepack(
    weight: torch.Tensor, kernel: LinearKernel = "onednn", gated_by: str | None = None
) -> PackedWeight | None:
    """The weight in `kernel`'s layout, or None where it cannot be packed (then use F.linear).
    `gated_by`: `weight` is a gated MLP's [gate; up] projection, which the C kernel then
    finishes as gated_by(gate) * up (gemm.GemmWeight); only a C kernel that applies that gate
    takes it (kernel_gate)."""
    if gated_by is not None and kernel_gate(kernel, gated_by) is None:
        raise ValueError(f"{kernel} does not finish a projection gated by {gated_by}")
    if not can_prepack(weight, kernel):
        return None
    if kernel in C_KERNEL_ARITHMETIC:
        return pack_weight(weight.detach(), gated_by, C_KERNEL_ARITHMETIC[kernel])
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
    except RuntimeError as error:  # an unusual build or shape: the plain path still works
        logger.warning("keeping a plain %s weight %s: %s", weight.dtype, tuple(weight.shape), error)
        return None


def kernel_gate(kernel: LinearKernel, activation: str | None) -> str | None:
    """`activation`, where `kernel` finishes a gated projection as activation(gate) * up
    itself; else None (the model's own pass does)."""
    if activation is None or kernel not in C_KERNEL_ARITHMETIC:
        return None
    return activation if gates(activation, C_KERNEL_ARITHMETIC[kernel]) else None


def copy_packed(packed_weight: PackedWeight) -> PackedWeight:
    """A copy of a packed weight in its own memory (oneDNN's opaque tensors copy too)."""
    if isinstance(packed_weight, GemmWeight):
        return dataclasses.replace(packed_weight, panels=packed_weight.panels.clone())
    return packed_weight.clone()


def packed_linear(
    x: torch.Tensor,
    packed_weight: PackedWeight,
    bias: torch.Tensor | None,
    activation: str | None = None,
) -> torch.Tensor:
    """x @ W^T + b with W prepacked; any leading dimensions, like F.linear. `activation` (a
    key of activations.ONEDNN_POST_OPS) is applied too: by oneDNN to each output block while
    it is still in cache, by the C kernel as it writes its outputs."""
    if isinstance(packed_weight, GemmWeight):
        if activation is None or applies_activation(activation, packed_weight.arithmetic):
            return gemm_linear(x, packed_weight, bias, activation)
        return ACTIVATIONS[activation](gemm_linear(x, packed_weight, bias))
    post_op, algorithm = ONEDNN_POST_OPS[activation] if activation else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, post_op, [], algorithm)


def meta_like(parameter: torch.Tensor) -> torch.nn.Parameter:
    """A parameter with `parameter`'s shape and dtype that holds no memory: what a layer keeps
    in place of a plain weight it no longer reads (any accidental read fails loudly)."""
    return torch.nn.Parameter(torch.empty_like(parameter, device="meta"), requires_grad=False)
