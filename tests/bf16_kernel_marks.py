"""Where the bf16-only C kernels' tests run: with their special instructions emulated in plain
C wherever a C compiler is (tiles.h's AMX tiles, paged_decode_bf16.c's VDPBF16PS), and on the
real instructions where the CPU has them.

The marks ask for the compiler and the CPU's flags, not whether a kernel is ready: a kernel
that builds but fails its self-check must fail these tests, not skip them.
"""

from __future__ import annotations

import os
import shutil

import pytest

from vacpack.cpu_kernels.build import AMX, REQUIRED_CPU_FLAGS, cpu_flags

HAS_COMPILER = shutil.which(os.environ.get("CC", "gcc")) is not None
HAS_AVX512_BF16 = HAS_COMPILER and set(REQUIRED_CPU_FLAGS) <= cpu_flags()
# The AMX builds take AVX-512 too (build.py's flags for non-portable kernels).
HAS_AMX = HAS_AVX512_BF16 and set(AMX.required_cpu_flags) <= cpu_flags()

EMULATED = pytest.mark.skipif(not HAS_COMPILER, reason="needs a C compiler")
ON_AVX512_BF16 = pytest.mark.skipif(
    not HAS_AVX512_BF16, reason="needs an x86 CPU with AVX512-BF16 and a C compiler"
)
ON_AMX = pytest.mark.skipif(
    not HAS_AMX, reason="needs an x86 CPU with AMX (Sapphire Rapids on) and a C compiler"
)
# The two ways to run a tile kernel, as parameters named as build.py's variants.
TILE_KERNELS = [
    pytest.param("emulated_tiles", marks=EMULATED, id="emulated"),
    pytest.param("amx", marks=ON_AMX, id="amx"),
]
# Every bf16-only decode kernel (cpu_kernels.paged_decode.BF16_DECODE_KERNELS), emulated and real.
BF16_DECODE_KERNELS = [
    pytest.param("emulated_dpbf16", marks=EMULATED, id="emulated-dpbf16"),
    pytest.param("avx512_bf16", marks=ON_AVX512_BF16, id="avx512-bf16"),
    *TILE_KERNELS,
]
