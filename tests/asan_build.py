"""A C kernel built with AddressSanitizer and exercised in a subprocess that preloads its
runtime (so torch's tensors are watched too): the bf16-only kernels' tests run their emulated
builds this way, since on the real instructions a stray row would read or write out of bounds
silently, or crash."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

KERNELS_DIR = Path(__file__).resolve().parent.parent / "vacpack" / "cpu_kernels"

# The start of a script that runs the bf16 varlen attention kernel built under ASan (the
# library's path in argv[1]) wherever vacpack would run its own build, on two threads.
VARLEN_BF16_PRELUDE = """
import ctypes, sys
import torch
from vacpack.cpu_kernels import attention

kernel = ctypes.CDLL(sys.argv[1]).varlen_attention_bf16
kernel.argtypes, kernel.restype = attention._ARGTYPES, ctypes.c_int
attention._kernel = lambda dtype, name="avx512_bf16": kernel
torch.set_num_threads(2)
"""


def worst_difference_under_asan(
    tmp_path: Path, source: str, define: str, script: str, args: Sequence[str] = ()
) -> float:
    """Builds cpu_kernels/`source`.c with -D`define` and AddressSanitizer, runs `script` (given
    the library's path, then `args`) under it, fails on any report or error, and returns the
    float the script printed after "worst difference". Skips where gcc has no ASan runtime."""
    compiler = shutil.which("gcc")
    runtime = ""
    if compiler:
        found = subprocess.run(
            [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True
        )
        runtime = found.stdout.strip()
    if not runtime or not Path(runtime).is_file():
        pytest.skip("needs gcc with AddressSanitizer's runtime")
    assert compiler is not None
    library = tmp_path / f"{source}_asan.so"
    flags = ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer", "-std=gnu11"]
    flags += ["-fPIC", "-shared", "-fopenmp", "-march=native", f"-D{define}"]
    source_path = KERNELS_DIR / f"{source}.c"
    subprocess.run([compiler, *flags, str(source_path), "-o", str(library), "-lm"], check=True)
    tests_dir = str(Path(__file__).parent)
    environment = {
        **os.environ,
        "LD_PRELOAD": runtime,
        "ASAN_OPTIONS": "detect_leaks=0",
        "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", script, str(library), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert "ERROR: AddressSanitizer" not in run.stderr, run.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]
    return float(run.stdout.split("worst difference")[1])
