"""Where the Triton kernels can run in a test: on a GPU, or on a CPU in Triton's interpreter.

tests/conftest.py switches the interpreter on only where no GPU is present: it must be chosen
before triton is imported, and with it on every kernel would run interpreted, the GPU's too.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETER_ON = os.environ.get("TRITON_INTERPRET") == "1"

# The kernels run somewhere here.
TRITON_RUNS = pytest.mark.skipif(
    not torch.cuda.is_available() and not INTERPRETER_ON,
    reason="no GPU, and TRITON_INTERPRET was set off (tests/conftest.py sets it on)",
)
# The kernels run on CPU tensors here: only in the interpreter, so not where a GPU is present
# (the same checks run there on the GPU).
ON_CPU = pytest.mark.skipif(
    not INTERPRETER_ON,
    reason="Triton kernels on CPU tensors need the interpreter, which is off where a GPU is",
)
