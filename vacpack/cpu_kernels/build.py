"""Compiles this package's C kernels once per machine and loads them with ctypes.

The kernels are plain C over raw pointers, so they build in about a second with the system's
C compiler and need neither torch's headers nor a Python binding layer. They link the OpenMP
runtime that torch itself loaded (same soname), so their threads are torch's threads and the
two never compete for cores. A machine without a compiler, or a CPU without the instructions
a kernel needs, simply runs the PyTorch paths instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# AVX-512 with the bf16 dot product (VDPBF16PS): Intel Cooper Lake and Sapphire Rapids on,
# AMD Zen 4 on.
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
BASE_COMPILE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")
# A portable kernel is plain C vectorised by the compiler for the CPU it is built on (AVX-512,
# AVX2, NEON): built per machine, and the CPU is part of its cache key.
PORTABLE_COMPILE_FLAGS = (*BASE_COMPILE_FLAGS, "-march=native")
COMPILE_FLAGS = (
    *BASE_COMPILE_FLAGS,
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mfma",
)


@dataclass(frozen=True)
class BuildVariant:
    """Another build of a kernel source: its name (part of the library's file name), the
    compiler flags it adds to its build's, and the CPU flags it needs besides theirs."""

    name: str
    extra_flags: tuple[str, ...]
    required_cpu_flags: tuple[str, ...] = ()


# AMX tiles for bf16 products (tiles.h): Intel Sapphire Rapids on.
AMX = BuildVariant("amx", ("-mamx-tile", "-mamx-bf16"), ("amx_tile", "amx_bf16"))
# tiles.h's operations in plain C, on any CPU: tests of a kernel's tile code without AMX.
EMULATED_TILES = BuildVariant("emulated_tiles", ("-DVACPACK_EMULATE_TILES",))
# paged_decode_bf16.c's VDPBF16PS in plain C, on any CPU: tests without AVX512-BF16.
EMULATED_DPBF16 = BuildVariant("emulated_dpbf16", ("-DVACPACK_EMULATE_DPBF16",))

# A C function of a loaded library, its argtypes set: called with ints, floats and pointers.
KernelFunction = Callable[..., Any]

DISABLE_ENV = "VACPACK_CPU_KERNELS"  # "0" turns the C kernels off
CACHE_ENV = "VACPACK_KERNEL_CACHE"  # where built libraries are kept


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _sources(pattern: str) -> list[Path]:
    return sorted(Path(__file__).parent.glob(pattern))


def _headers_bytes() -> bytes:
    """The shared headers beside the kernels (vec8.h), which a kernel's source may include."""
    return b"".join(header.read_bytes() for header in _sources("*.h"))


@functools.cache
def kernel_sources_digest() -> str:
    """A digest of every C kernel's source and header: timings measured with other kernels are
    stale."""
    digest = hashlib.sha256()
    for source in _sources("*.c") + _sources("*.h"):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:16]


def user_cache_root() -> Path:
    """vacpack's folder in the user's cache: built kernels and measured choices live here."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vacpack"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return user_cache_root() / "kernels"


def _compile(compiler: str, source: Path, target: Path, flags: tuple[str, ...]) -> None:
    """Builds into a temporary file beside the target and renames it into place, so that
    processes building at the same time never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    try:
        subprocess.run(
            [compiler, *flags, str(source), "-o", partial, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.cache
def load_kernel_library(
    name: str, portable: bool = False, variant: BuildVariant | None = None
) -> ctypes.CDLL | None:
    """The compiled library of `name`.c in this folder, or None where it cannot run here.

    portable: plain C that any x86 or ARM CPU runs, vectorised for this one (no CPU check).
    variant: built with its flags too, where the CPU has the flags it needs."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    flags = PORTABLE_COMPILE_FLAGS if portable else COMPILE_FLAGS
    required = () if portable else REQUIRED_CPU_FLAGS
    if variant is not None:
        flags = (*flags, *variant.extra_flags)
        required = (*required, *variant.required_cpu_flags)
    missing = [flag for flag in required if flag not in cpu_flags()]
    if missing:
        logger.info("CPU kernel %s off: this CPU lacks %s", name, ", ".join(missing))
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.warning("CPU kernels off: no C compiler found (set CC); using PyTorch kernels")
        return None
    source = Path(__file__).with_name(f"{name}.c")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    # The CPU's flags too: a library built with -march=native on one CPU may not run on another
    # that shares this cache (a home directory on a cluster); and the headers a kernel may
    # include.
    cpu = " ".join(sorted(cpu_flags()))
    digest = hashlib.sha256(
        source.read_bytes()
        + _headers_bytes()
        + " ".join(flags).encode()
        + version.encode()
        + cpu.encode()
    ).hexdigest()[:16]
    label = name if variant is None else f"{name}-{variant.name}"
    target = cache_dir() / f"{label}-{digest}.so"
    if not target.exists():
        try:
            _compile(compiler, source, target, flags)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            logger.warning(
                "CPU kernel %s failed to build; using PyTorch kernels:\n%s", name, detail
            )
            return None
    return ctypes.CDLL(str(target))


def kernel_function(
    library_name: str,
    function_name: str,
    argtypes: Sequence[Any],
    restype: Any = None,
    *,
    portable: bool = False,
    variant: BuildVariant | None = None,
) -> KernelFunction | None:
    """The C function `function_name` of library `library_name`, its argument and result types
    set on first use; None where the library cannot run here (see load_kernel_library)."""
    library = load_kernel_library(library_name, portable, variant)
    if library is None:
        return None
    function = getattr(library, function_name)
    if function.argtypes is None:
        function.argtypes = list(argtypes)
        function.restype = restype
    return function


@dataclass(frozen=True)
class ProvenKernel:
    """A kernel written where no CPU with its instructions was at hand (AMX tiles, VDPBF16PS):
    its library and function, its build, the function that asks the OS for the CPU state it
    needs first (0 when granted, else minus an errno; None: nothing to ask), and a self-check
    returning its largest difference from float32 attention on a small problem."""

    library: str
    function: str
    argtypes: Sequence[Any]
    portable: bool
    variant: BuildVariant | None
    ready_function: str | None
    self_check: Callable[[KernelFunction], float]
    tolerance: float
    label: str  # what the log calls it


def proven_kernel(kernel: ProvenKernel) -> KernelFunction | None:
    """The kernel's function once it builds, the OS grants its CPU state, and it passes its
    self-check within tolerance: it proves itself on the CPU that runs it before any model
    uses it. None otherwise, saying why in the log."""

    def function(name: str, argtypes: Sequence[Any]) -> KernelFunction | None:
        return kernel_function(
            kernel.library, name, argtypes, ctypes.c_int, portable=kernel.portable,
            variant=kernel.variant,
        )  # fmt: skip

    if kernel.ready_function is not None:
        ready = function(kernel.ready_function, [])
        if ready is None:
            return None
        error = ready()
        if error != 0:
            reason = os.strerror(-error) if error < 0 else str(error)
            logger.info("%s off: the OS refused the CPU state it needs (%s)", kernel.label, reason)
            return None
    loaded = function(kernel.function, kernel.argtypes)
    if loaded is None:
        return None
    difference = kernel.self_check(loaded)
    if difference > kernel.tolerance:
        logger.warning(
            "%s off: its self-check differs from float32 attention by %.3g",
            kernel.label,
            difference,
        )
        return None
    return loaded
