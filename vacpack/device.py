"""Which device and dtype to run on, and how many threads."""

from __future__ import annotations

import torch

from vacpack.tuning import MeasuredChoice

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}


def named_dtype(name: str) -> torch.dtype:
    """The dtype a configuration names (its dtype or kv_cache_dtype): bfloat16, float16 (half)
    or float32 (float)."""
    return _DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for, but no CUDA device is available")
    return device


def resolve_dtype(
    name: str,
    checkpoint_dtype: torch.dtype | None,
    device: torch.device,
    cpu_dtype_choice: MeasuredChoice | None = None,
) -> torch.dtype:
    """A named dtype is always honoured. auto: bfloat16 by default, the native training dtype
    of the model families we serve; float16 for a float16 checkpoint on CUDA. On a CPU, auto
    follows `cpu_dtype_choice` where one was measured (models/cpu_dtype.py): bfloat16 is many
    times faster than float32 with AVX512-BF16 or AMX, and many times slower without them."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" and checkpoint_dtype == torch.float16:
        return torch.float16
    if device.type == "cpu" and cpu_dtype_choice is not None:
        return _DTYPES[cpu_dtype_choice.chosen]
    return torch.bfloat16


def configure_threads(device: torch.device, num_threads: int | None) -> None:
    if device.type == "cpu" and num_threads is not None:
        torch.set_num_threads(num_threads)
