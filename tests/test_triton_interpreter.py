"""Runs the Triton kernel tests on a machine without a GPU, in Triton's interpreter.

The interpreter must be on (TRITON_INTERPRET=1) before triton is first imported, and in a test
session other imports (torch._dynamo, through transformers) import it early. So, when this
process has neither a GPU nor the interpreter, the kernel tests run in a child pytest that has
the variable from its start; in this process they skip themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

KERNEL_TEST_MODULES = ("test_triton_attention.py", "test_cuda_graphs.py")
CHILD_TIMEOUT_S = 600


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="the kernel tests run in this process",
)
def test_kernel_tests_pass_in_the_triton_interpreter() -> None:
    tests_dir = Path(__file__).parent
    result = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
            *(str(tests_dir / name) for name in KERNEL_TEST_MODULES),
        ],
        cwd=tests_dir.parent,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    # -rs lists skip reasons: only CUDA-only tests may skip there, none for want of the interpreter.
    assert "no Triton interpreter" not in result.stdout, result.stdout[-4000:]
