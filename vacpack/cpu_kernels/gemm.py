"""Linear layers on vacpack's own C kernels, weights packed once into the kernel's panels:
float32 arithmetic through gemm_f32.c (any CPU with a C compiler; the weights may be kept as
bfloat16, half the memory), or bf16 arithmetic through gemm_bf16.c (AVX512-BF16 CPUs,
gemm_bf16.py)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vacpack.cpu_kernels import gemm_bf16
from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.profiler_range import profiler_range

LIBRARY = "gemm_f32"
PROFILER_NAME = "vacpack::gemm"
# The activations the kernel applies to its outputs as it writes them (gemm_f32.c's ACT_*), by
# transformers' names (a config's hidden_act).
ACTIVATION_CODES: dict[str, int] = {
    "relu": 1,
    "gelu": 2,  # the exact (erf) GELU
    "gelu_new": 3,  # the tanh approximation
    "gelu_pytorch_tanh": 3,
    "silu": 4,
}
# A paired weight's panel: this many gate features, then the same up features (gemm_f32.c).
PAIRED_FEATURES = 8
# What the panels may hold; the inputs, outputs and arithmetic are float32 either way.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
_INT = ctypes.c_int64
_POINTER = ctypes.c_void_p


@dataclass(frozen=True)
class GemmWeight:
    """A [out_features, in_features] weight as a C kernel reads it. With float32 `arithmetic`,
    gemm_f32.c's: panels of 16 output features, each [in_features][16] (features past
    out_features zero), float32 or bfloat16. With bfloat16 arithmetic, gemm_bf16.c's: bfloat16
    panels of 16 output features, each [in_features / 2][16][2] (pairs of inputs, as VDPBF16PS
    reads them).

    Or, where `gated_by` names an activation, a gated MLP's [gate; up] projection with its
    halves paired (panels of 8 gate features, then the same 8 up features; 16 and 16 with
    bfloat16 arithmetic): the product is then activation(x @ gate^T) * (x @ up^T),
    out_features (the intermediate size) wide, and the 2x wider [gate | up] never goes to
    memory."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    gated_by: str | None = None
    arithmetic: torch.dtype = torch.float32  # also the inputs' and outputs' dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the product's is float32)."""
        return self.panels.dtype


def _function(
    name: str, argtypes: Sequence[object], restype: object = None
) -> KernelFunction | None:
    return kernel_function(LIBRARY, name, argtypes, restype, portable=True)


# Looked up once: gemm_linear runs for every linear layer of every step.
@functools.cache
def _pack_kernel(dtype: torch.dtype) -> KernelFunction | None:
    # w, n, k, w row stride, packed, threads
    name = "pack_weight_bf16" if dtype == torch.bfloat16 else "pack_weight_f32"
    return _function(name, [_POINTER, _INT, _INT, _INT, _POINTER, ctypes.c_int])


@functools.cache
def _gemm_kernel() -> KernelFunction | None:
    # x, m, k, x row stride, packed w, bf16 weights, n, bias, activation, paired, y, y row
    # stride, threads
    argtypes = [_POINTER, _INT, _INT, _INT, _POINTER, ctypes.c_int, _INT, _POINTER, ctypes.c_int]
    return _function(
        "gemm_f32", [*argtypes, ctypes.c_int, _POINTER, _INT, ctypes.c_int], ctypes.c_int
    )


def applies_activation(name: str, arithmetic: torch.dtype = torch.float32) -> bool:
    """Whether the kernel of `arithmetic` applies activation `name` to its outputs itself
    (else the caller applies it). The bf16 kernel applies none."""
    return arithmetic == torch.float32 and name in ACTIVATION_CODES


def gates(name: str, arithmetic: torch.dtype = torch.float32) -> bool:
    """Whether the kernel of `arithmetic` finishes a gated projection as name(gate) * up."""
    if arithmetic == torch.bfloat16:
        return name in gemm_bf16.GATES
    return name in ACTIVATION_CODES


def gemm_supported(weight_dtype: torch.dtype, arithmetic: torch.dtype = torch.float32) -> bool:
    """Whether the C kernel of `arithmetic` runs here (it builds on this machine, on this CPU)
    on `weight_dtype` weights."""
    if arithmetic == torch.bfloat16:
        return weight_dtype == torch.bfloat16 and gemm_bf16.supported()
    return (
        weight_dtype in WEIGHT_DTYPES
        and _gemm_kernel() is not None
        and _pack_kernel(weight_dtype) is not None
    )


def pair_halves(gate_up: torch.Tensor, features: int = PAIRED_FEATURES) -> torch.Tensor:
    """A [gate; up] stack (a weight's rows or a bias, 2 x the intermediate size) reordered into
    paired panels: `features` gate rows, the same up rows, and so on; each half padded with
    zeros to a multiple of `features`."""
    gate, up = gate_up.chunk(2)
    size, rest = gate.shape[0], gate.shape[1:]
    num_pairs = -(-size // features)
    pairs = gate_up.new_zeros(num_pairs, 2, features, *rest)
    for half, rows in enumerate((gate, up)):
        padded = gate_up.new_zeros(num_pairs * features, *rest)
        padded[:size] = rows
        pairs[:, half] = padded.view(num_pairs, features, *rest)
    return pairs.view(2 * num_pairs * features, *rest)


def pack_weight(
    weight: torch.Tensor, gated_by: str | None = None, arithmetic: torch.dtype = torch.float32
) -> GemmWeight:
    """`weight` ([out, in] float32 or bfloat16 on the CPU) in the panels of the kernel of
    `arithmetic`, of its dtype; a copy, so the plain weight can be dropped. With `gated_by`
    (see `gates`), `weight` is a gated MLP's [gate; up] projection, packed with its halves
    paired (see GemmWeight)."""
    if weight.dtype not in WEIGHT_DTYPES or weight.device.type != "cpu":
        raise ValueError(f"pack_weight takes float32 or bfloat16 CPU weights, not {weight.dtype}")
    if not gemm_supported(weight.dtype, arithmetic):
        raise RuntimeError(f"no C kernel runs {arithmetic} products on {weight.dtype} weights here")
    if weight.dim() != 2 or weight.stride(1) != 1:
        weight = weight.reshape(weight.shape[0], -1).contiguous()
    if gated_by is not None:
        if not gates(gated_by, arithmetic) or weight.shape[0] % 2:
            raise ValueError(f"cannot pair a {tuple(weight.shape)} weight gated by {gated_by!r}")
        paired = pair_halves(weight, _paired_features(arithmetic))
        packed = pack_weight(paired, arithmetic=arithmetic)
        return GemmWeight(
            packed.panels, weight.shape[0] // 2, weight.shape[1], gated_by, arithmetic
        )
    if arithmetic == torch.bfloat16:
        out_features, in_features = weight.shape
        panels = gemm_bf16.pack_panels(weight)
        return GemmWeight(panels, out_features, in_features, arithmetic=arithmetic)
    kernel = _pack_kernel(weight.dtype)
    assert kernel is not None  # gemm_supported
    out_features, in_features = weight.shape
    num_panels = -(-out_features // 16)
    panels = torch.empty(num_panels * in_features * 16, dtype=weight.dtype)
    kernel(
        weight.data_ptr(),
        out_features,
        in_features,
        weight.stride(0),
        panels.data_ptr(),
        torch.get_num_threads(),
    )
    return GemmWeight(panels, out_features, in_features)


def gemm_linear(
    x: torch.Tensor,
    weight: GemmWeight,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """activation(x @ weight^T + bias), with any leading dimensions, like F.linear;
    `activation` a key of ACTIVATION_CODES or None. For a weight gated by an activation,
    activation(x @ gate^T + gate bias) * (x @ up^T + up bias), `bias` as [gate; up]."""
    if x.dtype != weight.arithmetic or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"input {tuple(x.shape)} {x.dtype} does not fit a {weight.shape} weight (the "
            f"kernel takes {weight.arithmetic} inputs)"
        )
    if weight.gated_by is not None and activation is not None:
        raise ValueError(f"a weight gated by {weight.gated_by} takes no other activation")
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if weight.arithmetic == torch.bfloat16:
        if activation is not None:
            raise ValueError(f"the bf16 kernel applies no {activation}: apply it after")
        return _bf16_linear(rows, weight, bias).view(*x.shape[:-1], weight.out_features)
    kernel = _gemm_kernel()
    if kernel is None:
        raise RuntimeError("the gemm_f32 kernel does not run here")
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
    if rows.shape[0]:
        if bias is not None:
            bias = bias.to(torch.float32)
            bias = (pair_halves(bias) if weight.gated_by else bias).contiguous()
        activation = weight.gated_by or activation
        with profiler_range(PROFILER_NAME):
            status = kernel(
                rows.data_ptr(),
                rows.shape[0],
                weight.in_features,
                rows.stride(0),
                weight.panels.data_ptr(),
                weight.dtype == torch.bfloat16,
                weight.out_features,
                bias.data_ptr() if bias is not None else None,
                ACTIVATION_CODES[activation] if activation else 0,
                weight.gated_by is not None,
                out.data_ptr(),
                out.stride(0),
                torch.get_num_threads(),
            )
        if status != 0:
            raise MemoryError("gemm_f32 could not allocate its activation buffer")
    return out.view(*x.shape[:-1], weight.out_features)


def _paired_features(arithmetic: torch.dtype) -> int:
    return gemm_bf16.PANEL_FEATURES if arithmetic == torch.bfloat16 else PAIRED_FEATURES


def _bf16_linear(rows: torch.Tensor, weight: GemmWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        bias = bias.to(torch.float32)
        if weight.gated_by:  # pairing pads each half to whole panels too
            bias = pair_halves(bias, gemm_bf16.PANEL_FEATURES)
    gated = weight.gated_by is not None
    return gemm_bf16.linear(rows, weight.panels, weight.out_features, bias, gated)
