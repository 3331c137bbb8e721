"""The C kernels' ctypes calls carry a named range in a running torch.profiler's trace, and no
range (whose entry and exit cost more than many small kernels' work) when none runs."""

from __future__ import annotations

import contextlib

import torch
from test_cpu_kernels import _cu, _random

from vacpack.cpu_kernels.attention import PROFILER_NAME, varlen_attention
from vacpack.cpu_kernels.profiler_range import profiler_range


def _attention_call() -> None:
    generator = torch.Generator().manual_seed(0)
    lens = [5, 3]
    q = _random(sum(lens), 4, 32, generator, torch.float32)
    k = _random(sum(lens), 2, 32, generator, torch.float32)
    v = _random(sum(lens), 2, 32, generator, torch.float32)
    varlen_attention(q, k, v, _cu(lens), _cu(lens), causal=True)


def test_a_running_profiler_sees_the_kernel_by_name() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        _attention_call()
    names = {event.key for event in profiler.key_averages()}
    assert PROFILER_NAME in names


def test_no_range_is_opened_without_a_profiler() -> None:
    assert isinstance(profiler_range(PROFILER_NAME), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not isinstance(profiler_range(PROFILER_NAME), contextlib.nullcontext)
