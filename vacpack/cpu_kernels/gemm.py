"""float32 linear layers through gemm_f32.c: weights packed once into the kernel's panels,
products register-blocked for the CPU at hand (any CPU with a C compiler)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function

LIBRARY = "gemm_f32"
PROFILER_NAME = "vacpack::gemm"
# The activations the kernel applies to its outputs as it writes them (gemm_f32.c's ACT_*), by
# transformers' names (a config's hidden_act).
ACTIVATION_CODES: dict[str, int] = {
    "relu": 1,
    "gelu": 2,  # the exact (erf) GELU
    "gelu_new": 3,  # the tanh approximation
    "gelu_pytorch_tanh": 3,
}
_INT = ctypes.c_int64
_POINTER = ctypes.c_void_p


@dataclass(frozen=True)
class GemmWeight:
    """A [out_features, in_features] weight as gemm_f32.c reads it: panels of 16 output
    features, each [in_features][16] (features past out_features zero)."""

    panels: torch.Tensor
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)


def _function(
    name: str, argtypes: Sequence[object], restype: object = None
) -> KernelFunction | None:
    return kernel_function(LIBRARY, name, argtypes, restype, portable=True)


# Looked up once: gemm_linear runs for every linear layer of every step.
@functools.cache
def _pack_kernel() -> KernelFunction | None:
    # w, n, k, w row stride, packed, threads
    return _function("pack_weight_f32", [_POINTER, _INT, _INT, _INT, _POINTER, ctypes.c_int])


@functools.cache
def _gemm_kernel() -> KernelFunction | None:
    # x, m, k, x row stride, packed w, n, bias, activation, y, y row stride, threads
    argtypes = [_POINTER, _INT, _INT, _INT, _POINTER, _INT, _POINTER, ctypes.c_int, _POINTER, _INT]
    return _function("gemm_f32", [*argtypes, ctypes.c_int], ctypes.c_int)


def applies_activation(name: str) -> bool:
    """Whether the kernel applies activation `name` itself (else the caller applies it)."""
    return name in ACTIVATION_CODES


def gemm_supported(dtype: torch.dtype) -> bool:
    """Whether float32 linears can run through the C kernel here (it builds on this machine)."""
    return dtype == torch.float32 and _gemm_kernel() is not None and _pack_kernel() is not None


def pack_weight(weight: torch.Tensor) -> GemmWeight:
    """`weight` ([out, in] float32 on the CPU) in the kernel's panels; a copy, so the plain
    weight can be dropped."""
    kernel = _pack_kernel()
    if kernel is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise RuntimeError("pack_weight needs a float32 CPU weight and the gemm_f32 kernel")
    if weight.dim() != 2 or weight.stride(1) != 1:
        weight = weight.reshape(weight.shape[0], -1).contiguous()
    out_features, in_features = weight.shape
    num_panels = -(-out_features // 16)
    panels = torch.empty(num_panels * in_features * 16, dtype=torch.float32)
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
    `activation` a key of ACTIVATION_CODES or None."""
    kernel = _gemm_kernel()
    if kernel is None:
        raise RuntimeError("the gemm_f32 kernel does not run here")
    if x.dtype != torch.float32 or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"input {tuple(x.shape)} {x.dtype} does not fit a float32 weight {weight.shape}"
        )
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
    if rows.shape[0]:
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        # Named for torch.profiler, which cannot see into a ctypes call otherwise.
        with torch.profiler.record_function(PROFILER_NAME):
            status = kernel(
                rows.data_ptr(),
                rows.shape[0],
                weight.in_features,
                rows.stride(0),
                weight.panels.data_ptr(),
                weight.out_features,
                bias.data_ptr() if bias is not None else None,
                ACTIVATION_CODES[activation] if activation else 0,
                out.data_ptr(),
                out.stride(0),
                torch.get_num_threads(),
            )
        if status != 0:
            raise MemoryError("gemm_f32 could not allocate its activation buffer")
    return out.view(*x.shape[:-1], weight.out_features)
