"""Linear-layer weights reordered once into oneDNN's blocked layout, for matmuls on a CPU.

`F.linear` on a CPU hands oneDNN a plain [out, in] weight, and oneDNN reorders it into the
blocked (for bf16 on AMX: VNNI-packed) layout its kernels read, on every call. For a prefill
step the reorder is a few percent of the matmul; for a decode step, where a handful of rows
meet the whole weight, it is most of it. Reordering once at load time, as torch.compile's
CPU freezing pass does, and calling oneDNN's linear on the packed weight removes it. Measured
on a 2-core bf16 CPU (Qwen2.5-0.5B shapes): the [9728, 896] gate/up projection 0.63 -> 0.21 ms
for one row, 2.3 -> 1.7 ms for 64 rows, 11.6 -> 10.8 ms for 512; the same numbers bit for bit.

The packed tensor is opaque (no strides, no storage): it serves the matmul and nothing else,
so a layer that packs its weight keeps only the packed copy, unless its plain table is still
read elsewhere (a tied embedding).
"""

from __future__ import annotations

import logging
import os

import torch

from vacpack.models.activations import ONEDNN_POST_OPS

logger = logging.getLogger(__name__)

# Rows the packed layout is tuned for: oneDNN picks blocking from it, and every row count still
# runs. Against no hint, 512 measured as fast or faster from 1 to 2,048 rows (1.3x at 7 rows,
# 4% at 2,048); a hint equal to the rows was within a few percent of it at 64, 512 and 2,048.
PACK_FOR_ROWS = 512
# Setting this to 0 keeps plain weights and F.linear: a switch for comparisons and debugging.
DISABLE_ENV = "VACPACK_CPU_PREPACK"


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `weight` is a CPU tensor oneDNN can pack on this machine."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout, or None where it cannot be packed (then use F.linear)."""
    if not can_prepack(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
    except RuntimeError as error:  # an unusual build or shape: the plain path still works
        logger.warning("keeping a plain %s weight %s: %s", weight.dtype, tuple(weight.shape), error)
        return None


def packed_linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = None,
) -> torch.Tensor:
    """x @ W^T + b with W prepacked; any leading dimensions, like F.linear. `activation` (a
    key of activations.ONEDNN_POST_OPS) is applied to each output block while it is still in
    cache, instead of in another pass over the whole output."""
    post_op, algorithm = ONEDNN_POST_OPS[activation] if activation else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, post_op, [], algorithm)


def meta_like(parameter: torch.Tensor) -> torch.nn.Parameter:
    """A parameter with `parameter`'s shape and dtype that holds no memory: what a layer keeps
    in place of a plain weight it no longer reads (any accidental read fails loudly)."""
    return torch.nn.Parameter(torch.empty_like(parameter, device="meta"), requires_grad=False)
