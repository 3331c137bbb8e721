"""Where the AMX kernels' tests run: with their tile instructions emulated in plain C wherever a
C compiler is (tiles.h), and on the real tiles where the CPU has AMX.

The marks ask for the compiler and the CPU's flags, not whether a kernel is ready: a kernel
that builds but fails its self-check must fail these tests, not skip them.
"""

from __future__ import annotations

import os
import shutil

import pytest

from vacpack.cpu_kernels.build import AMX, REQUIRED_CPU_FLAGS, cpu_flags

HAS_COMPILER = shutil.which(os.environ.get("CC", "gcc")) is not None
# The AMX builds take AVX-512 too (build.py's flags for non-portable kernels).
HAS_AMX = HAS_COMPILER and {*REQUIRED_CPU_FLAGS, *AMX.required_cpu_flags} <= cpu_flags()

EMULATED = pytest.mark.skipif(not HAS_COMPILER, reason="needs a C compiler")
ON_AMX = pytest.mark.skipif(
    not HAS_AMX, reason="needs an x86 CPU with AMX (Sapphire Rapids on) and a C compiler"
)
# The two ways to run a tile kernel, as parameters named as build.py's variants.
TILE_KERNELS = [
    pytest.param("emulated_tiles", marks=EMULATED, id="emulated"),
    pytest.param("amx", marks=ON_AMX, id="amx"),
]
