"""The elementwise ops of a model's layers, and which implementation a model is built with.

A decoder block's are RMSNorm (alone and after the residual add), SiLU(gate) * up and rotary
embeddings; a post-norm encoder block's, its residual add with LayerNorm.

`LayerOps` is PyTorch's own ops, portable and the reference; `CpuKernelLayerOps` runs each op
as one fused C pass on CPUs (vacpack/cpu_kernels: elementwise.c for bf16 where the CPU has
AVX512-BF16, elementwise_f32.c for float32 on any CPU), and `TritonLayerOps`
(triton_layer_ops.py) as one fused Triton kernel on GPUs, each rounding where the PyTorch ops
round. Each declares where it runs; where both run, each op takes the one measured
faster at the model's shapes (layer_ops_choice.py, `PerOpLayerOps`). The loader builds the
model inside `use_layer_ops(...)`, so every layer holds its ops from construction on and nothing
is switched after loading.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vacpack.cpu_kernels import elementwise
from vacpack.models.activations import act_and_mul
from vacpack.models.rotary import apply_rotary
from vacpack.registry import LazyRegistry

# Rows of the packed stream per MLP pass on a CPU. A 2048-token step's [tokens, 2 * intermediate]
# activation is tens of MB; in slices of 512 rows it stays in the CPU's caches, and the matmuls
# measured 15-25% faster on a 2-core bf16 CPU. On a GPU one pass covers the whole step.
CPU_MLP_ROWS_PER_PASS = 512


class LayerOps:
    """PyTorch's ops: RMSNorm in float32 as the reference implementations compute it."""

    name = "torch"

    def __init__(self, mlp_rows_per_pass: int | None = None) -> None:
        self.mlp_rows_per_pass = mlp_rows_per_pass

    def portable(self) -> LayerOps:
        """PyTorch's ops with the same row slicing: for layers the fused kernels do not cover."""
        return LayerOps(self.mlp_rows_per_pass)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x_float.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the sum may be written into `residual`."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return act_and_mul(gate_up, "silu")

    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)

    def add_layer_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """LayerNorm(x + residual) over the last dimension."""
        return F.layer_norm(x + residual, weight.shape, weight, bias, eps)

    def implements(self, op: str, dtype: torch.dtype) -> bool:
        """Whether `op` on `dtype` runs code of this implementation's own, not the PyTorch ops
        it inherits (which the reference, this class, runs for every op)."""
        return type(self) is LayerOps or getattr(type(self), op) is not getattr(LayerOps, op)


class CpuKernelLayerOps(LayerOps):
    """One fused C pass per op over rows that stay in L1; layouts the kernels do not take
    (Qwen3's strided per-head norms) go to PyTorch's ops."""

    name = "cpu_kernels"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1:
            return elementwise.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_contiguous() and residual.is_contiguous():
            return elementwise.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return elementwise.silu_and_mul(gate_up)

    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return elementwise.rotary_qk(q, k, *cos_sin)

    def add_layer_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        # The kernel is float32's (built with the rms_norm one this class needs to be chosen).
        fused = x.dtype == torch.float32 and x.dim() == 2
        if fused and x.is_contiguous() and residual.is_contiguous():
            return elementwise.add_layer_norm(x, residual, weight, bias, eps)
        return super().add_layer_norm(x, residual, weight, bias, eps)

    def implements(self, op: str, dtype: torch.dtype) -> bool:
        cpu = torch.device("cpu")
        return super().implements(op, dtype) and elementwise.elementwise_kernels_available(
            cpu, dtype, op
        )


# The ops a decoder block calls, and a post-norm encoder block's.
DECODER_LAYER_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk")
ENCODER_LAYER_OPS = ("add_layer_norm",)
OP_NAMES = DECODER_LAYER_OPS + ENCODER_LAYER_OPS


class PerOpLayerOps(LayerOps):
    """Each op from its own implementation: the one measured fastest for it at the model's
    shapes (layer_ops_choice.py); an op not given (one the model's layers never call) runs
    PyTorch's."""

    def __init__(self, mlp_rows_per_pass: int | None, ops_by_name: dict[str, LayerOps]) -> None:
        super().__init__(mlp_rows_per_pass)
        unknown = set(ops_by_name) - set(OP_NAMES)
        if unknown:
            raise ValueError(f"no such layer ops: {sorted(unknown)}")
        self.ops_by_name = ops_by_name
        self.name = ", ".join(
            f"{op} {ops_by_name[op].name}" for op in OP_NAMES if op in ops_by_name
        )
        self._torch = LayerOps(mlp_rows_per_pass)

    def _for(self, op: str) -> LayerOps:
        return self.ops_by_name.get(op, self._torch)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._for("rms_norm").rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._for("add_rms_norm").add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._for("silu_and_mul").silu_and_mul(gate_up)

    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._for("rotary_qk").rotary_qk(q, k, cos_sin)

    def add_layer_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        return self._for("add_layer_norm").add_layer_norm(x, residual, weight, bias, eps)

    def implements(self, op: str, dtype: torch.dtype) -> bool:
        return self._for(op).implements(op, dtype)


@dataclass(frozen=True)
class LayerOpsSpec:
    name: str
    target: str  # "package.module:Class"
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype] | None = None  # None: any
    needs_cpu_kernels: bool = False  # the C library must build here
    needs_triton: bool = False  # the triton package must be installed

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type not in self.devices:
            return False
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        if self.needs_triton and importlib.util.find_spec("triton") is None:
            return False
        return not self.needs_cpu_kernels or elementwise.elementwise_kernels_available(
            device, dtype
        )


# Preferred first, where eligible and nothing was measured.
LAYER_OPS_SPECS: tuple[LayerOpsSpec, ...] = (
    LayerOpsSpec(
        name="cpu_kernels",
        target="vacpack.models.layer_ops:CpuKernelLayerOps",
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        needs_cpu_kernels=True,
    ),
    LayerOpsSpec(
        name="torch",
        target="vacpack.models.layer_ops:LayerOps",
        devices=frozenset({"cpu", "cuda"}),
    ),
    LayerOpsSpec(
        name="triton",
        target="vacpack.models.triton_layer_ops:TritonLayerOps",
        devices=frozenset({"cuda"}),
        needs_triton=True,
    ),
)

LAYER_OPS: LazyRegistry[type[LayerOps]] = LazyRegistry(
    "layer ops", {spec.name: spec.target for spec in LAYER_OPS_SPECS}
)


def eligible_layer_ops(device: torch.device, dtype: torch.dtype) -> dict[str, LayerOps]:
    """Every set of ops that runs on this device in this dtype, preferred first."""
    rows_per_pass = CPU_MLP_ROWS_PER_PASS if device.type == "cpu" else None
    return {
        spec.name: LAYER_OPS.get(spec.name)(mlp_rows_per_pass=rows_per_pass)
        for spec in LAYER_OPS_SPECS
        if spec.supports(device, dtype)
    }


def select_layer_ops(device: torch.device, dtype: torch.dtype) -> LayerOps:
    """The preferred ops that run on this device in this dtype, where nothing was measured
    (a model loaded for a test; runtime.load measures: layer_ops_choice.py)."""
    return next(iter(eligible_layer_ops(device, dtype).values()))


_current_ops: list[LayerOps] = []


@contextlib.contextmanager
def use_layer_ops(ops: LayerOps) -> Iterator[None]:
    """Layers built inside the block take `ops` (outside any block: PyTorch's own)."""
    _current_ops.append(ops)
    try:
        yield
    finally:
        _current_ops.pop()


def current_layer_ops() -> LayerOps:
    return _current_ops[-1] if _current_ops else LayerOps()
