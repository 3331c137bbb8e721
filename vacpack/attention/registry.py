"""The attention backends, what each one supports, and the options each one takes.

Each backend declares where it can run: devices, dtypes, head sizes, and the phases it
implements (PACKED: whole sequences in one stream without a KV cache, as corpus bins and
encoders run; PAGED: engine steps over the paged KV cache, decodes and prefill chunks mixed).
What only the machine can tell (a package installed, a C kernel that builds and has the
instructions it needs) is checked last and lazily. "auto" times the eligible backends at the
model's shapes and takes the fastest (selection.py); the portable torch_sdpa backend runs
everywhere and is the reference the others are tested against.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vacpack.attention.backend import AttentionBackend, AttentionSpec
from vacpack.registry import LazyRegistry


class Phase(enum.Enum):
    PACKED = "packed"  # whole sequences in one stream, no KV cache: corpus bins, encoders
    PAGED = "paged"  # engine steps over the paged KV cache


@dataclass(frozen=True)
class BackendSpec:
    name: str
    target: str  # "package.module:Class", imported on first use
    devices: frozenset[str]
    phases: frozenset[Phase]
    dtypes: frozenset[torch.dtype] | None = None  # None: any
    head_dim_multiple: int = 1
    max_head_dim: int | None = None
    # Checked last, once the static constraints hold: what only this machine can tell.
    available: Callable[[torch.device, torch.dtype | None, int | None], bool] | None = None
    # Where "auto" may pick it (default: everywhere it runs); it runs elsewhere only if forced.
    auto_devices: frozenset[str] | None = None
    # Constructor options that measured selection may set (cascade: a CascadePolicy or None;
    # blocked_prefill: long causal prefills as blocked matmuls or not; decode_form: decodes as
    # plain matmuls, through SDPA's kernel or through the C paged-decode kernel; prefix_form: a
    # cascade's shared prefixes as matmuls or through the C varlen kernel; bf16_kernel and
    # prefix_bf16_kernel: the C kernel's bf16 products, and those of a cascade's prefixes, on
    # AVX-512 registers or AMX tiles).
    options: frozenset[str] = frozenset()

    def supports(
        self, device: torch.device, dtype: torch.dtype | None, head_dim: int | None, phase: Phase
    ) -> bool:
        if device.type not in self.devices or phase not in self.phases:
            return False
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        if self.head_dim_multiple > 1 or self.max_head_dim is not None:
            if head_dim is None or head_dim % self.head_dim_multiple:
                return False
            if self.max_head_dim is not None and head_dim > self.max_head_dim:
                return False
        return self.available is None or self.available(device, dtype, head_dim)


def _triton_runs(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> bool:
    # On a CPU only in Triton's interpreter, which the kernels' tests use.
    on_device = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and importlib.util.find_spec("triton") is not None


def _cpu_kernels_build(
    device: torch.device, dtype: torch.dtype | None, head_dim: int | None
) -> bool:
    # Imported here: asking builds (or loads) the C library, which only this check needs.
    from vacpack.cpu_kernels import varlen_attention_supported

    if dtype is None or head_dim is None:
        return False
    return varlen_attention_supported(device, dtype, head_dim)


BOTH_PHASES = frozenset(Phase)

# In the order the error messages list them; "auto" picks among them by measurement.
BACKEND_SPECS: tuple[BackendSpec, ...] = (
    BackendSpec(
        name="triton",
        target="vacpack.attention.triton_backend:TritonBackend",
        devices=frozenset({"cuda", "cpu"}),
        phases=BOTH_PHASES,
        available=_triton_runs,
        auto_devices=frozenset({"cuda"}),
    ),
    BackendSpec(
        name="cpu_kernels",
        target="vacpack.attention.cpu_kernel_backend:CpuKernelBackend",
        devices=frozenset({"cpu"}),
        phases=BOTH_PHASES,
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        # 8 for float32 and 32 for bf16: the kernels' own check (_cpu_kernels_build) says which.
        head_dim_multiple=8,
        max_head_dim=256,
        available=_cpu_kernels_build,
        options=frozenset({"cascade", "bf16_kernel", "prefix_bf16_kernel"}),
    ),
    BackendSpec(
        name="torch_sdpa",
        target="vacpack.attention.torch_sdpa:TorchSdpaBackend",
        devices=frozenset({"cpu", "cuda"}),
        phases=BOTH_PHASES,
        options=frozenset({"cascade", "blocked_prefill", "decode_form", "prefix_form"}),
    ),
)
SPECS_BY_NAME = {spec.name: spec for spec in BACKEND_SPECS}

BACKENDS: LazyRegistry[type[AttentionBackend]] = LazyRegistry(
    "attention backend", {spec.name: spec.target for spec in BACKEND_SPECS}
)


def eligible_backends(
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    phase: Phase = Phase.PAGED,
) -> list[str]:
    """The backends that can run this phase for this model here, in declaration order."""
    return [spec.name for spec in BACKEND_SPECS if spec.supports(device, dtype, head_dim, phase)]


def auto_candidates(
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    phase: Phase = Phase.PAGED,
) -> list[str]:
    """The eligible backends that "auto" may pick here (those it times against each other)."""
    return [
        spec.name
        for spec in BACKEND_SPECS
        if device.type in (spec.auto_devices or spec.devices)
        and spec.supports(device, dtype, head_dim, phase)
    ]


def resolve_backend_name(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    phase: Phase = Phase.PAGED,
) -> str:
    """`name` itself when that backend is eligible here, else a ValueError saying what it does
    not support ("auto" is resolved by measurement: see selection.py)."""
    eligible = eligible_backends(device, dtype, head_dim, phase)
    if name not in BACKENDS:
        BACKENDS.get(name)  # raises, listing the known backends
    if name not in eligible:
        raise ValueError(
            f"attention backend {name!r} cannot run {phase.value} attention for a "
            f"{str(dtype).removeprefix('torch.')} model with head size {head_dim} on {device} "
            f"here; eligible: {', '.join(eligible)}"
        )
    return name


def create_backend(name: str, **options: Any) -> AttentionBackend:
    """A backend built with those of `options` it declares (the others do not apply to it)."""
    accepted = SPECS_BY_NAME[name].options if name in SPECS_BY_NAME else frozenset()
    return BACKENDS.get(name)(**{key: value for key, value in options.items() if key in accepted})


def unsupported_reasons(backend: AttentionBackend, specs: Sequence[AttentionSpec]) -> list[str]:
    """Why `backend` cannot run every layer attending as `specs` say (empty: it can)."""
    return sorted({reason for spec in set(specs) if (reason := backend.unsupported(spec))})
