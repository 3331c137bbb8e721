"""The decoder block's elementwise ops on CPU tensors, each one pass over its rows: RMSNorm
(alone or after the residual add), SiLU(gate) * up and rotary embeddings. bf16 from
elementwise.c (AVX512-BF16; rounding where PyTorch's ops round), float32 from elementwise_f32.c
(plain C vectorised for the CPU at hand: any CPU with a C compiler). And an encoder block's
residual add with LayerNorm, float32 only."""

from __future__ import annotations

import ctypes

import torch

from vacpack.cpu_kernels.build import KernelFunction, kernel_function
from vacpack.cpu_kernels.token_rows import heads_side_by_side

_POINTER, _INT, _FLOAT, _THREADS = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

# Per dtype: the library, whether it is portable (built for any CPU), and its name suffix.
_LIBRARIES: dict[torch.dtype, tuple[str, bool, str]] = {
    torch.bfloat16: ("elementwise", False, "bf16"),
    torch.float32: ("elementwise_f32", True, "f32"),
}

_SIGNATURES: dict[str, list[type]] = {
    # x, x row stride, weight, out, rows, columns, eps, threads
    "rms_norm": [_POINTER, _INT, _POINTER, _POINTER, _INT, _INT, _FLOAT, _THREADS],
    # x, residual (updated in place), weight, out, rows, columns, eps, threads
    "add_rms_norm": [_POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT, _FLOAT, _THREADS],
    # x, residual, weight, bias, out, rows, columns, eps, threads
    "add_layer_norm": [*[_POINTER] * 5, _INT, _INT, _FLOAT, _THREADS],
    # gate_up, its row stride, out, rows, columns of out, threads
    "silu_and_mul": [_POINTER, _INT, _POINTER, _INT, _INT, _THREADS],
    # q, its token stride, its heads; k, its token stride, its heads; cos, sin, their token
    # stride; q out, k out; tokens, head_dim, threads
    "rotary_qk": [
        *(_POINTER, _INT, _INT),
        *(_POINTER, _INT, _INT),
        *(_POINTER, _POINTER, _INT),
        *(_POINTER, _POINTER),
        *(_INT, _INT, _THREADS),
    ],
}
# Ops whose kernel exists in float32 alone (elementwise_f32.c).
_FLOAT32_ONLY = frozenset({"add_layer_norm"})


def _function(op: str, dtype: torch.dtype) -> KernelFunction | None:
    if dtype not in _LIBRARIES or (op in _FLOAT32_ONLY and dtype != torch.float32):
        return None
    library, portable, suffix = _LIBRARIES[dtype]
    return kernel_function(library, f"{op}_{suffix}", _SIGNATURES[op], portable=portable)


def _kernel(op: str, dtype: torch.dtype) -> KernelFunction:
    function = _function(op, dtype)
    if function is None:
        raise RuntimeError(f"the {op} CPU kernel for {dtype} cannot run here (see the log)")
    return function


def elementwise_kernels_available(
    device: torch.device, dtype: torch.dtype, op: str = "rms_norm"
) -> bool:
    """Whether a model on `device` in `dtype` can run its norms, activation and rotary here
    (with `op`: that op's kernel)."""
    return device.type == "cpu" and _function(op, dtype) is not None


def _check(name: str, condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {what}")


def _on_cpu(name: str, x: torch.Tensor) -> None:
    _check(name, x.device.type == "cpu" and x.dtype in _LIBRARIES, "needs bf16 or float32 CPU")


def _rows(name: str, x: torch.Tensor) -> None:
    _on_cpu(name, x)
    _check(name, x.dim() == 2 and x.stride(1) == 1, f"needs 2-D rows, got {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [rows, hidden] (rows may be strided), as a new tensor."""
    _rows("rms_norm", x)
    _check("rms_norm", weight.shape == (x.shape[1],) and weight.dtype == x.dtype, "bad weight")
    out = torch.empty(x.shape, dtype=x.dtype)
    _normalize("rms_norm", x, x.stride(0), weight, out, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); the sum is written into `residual` in place."""
    _rows("add_rms_norm", x)
    _check("add_rms_norm", x.is_contiguous() and residual.is_contiguous(), "needs contiguous rows")
    _check("add_rms_norm", residual.shape == x.shape and residual.dtype == x.dtype, "bad residual")
    _check("add_rms_norm", weight.shape == (x.shape[1],) and weight.dtype == x.dtype, "bad weight")
    out = torch.empty_like(x)
    _normalize("add_rms_norm", x, residual.data_ptr(), weight, out, eps)
    return out, residual


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm(x + residual) over the last dimension of float32 rows [rows, hidden], as a new
    tensor: a post-norm encoder block's residual add and norm in one pass."""
    _rows("add_layer_norm", x)
    contiguous = x.is_contiguous() and residual.is_contiguous()
    _check("add_layer_norm", contiguous, "needs contiguous rows")
    same = residual.shape == x.shape and residual.dtype == x.dtype
    _check("add_layer_norm", same, "bad residual")
    for name, vector in (("weight", weight), ("bias", bias)):
        fits = vector.shape == (x.shape[1],) and vector.dtype == x.dtype and vector.is_contiguous()
        _check("add_layer_norm", fits, f"bad {name}")
    out = torch.empty_like(x)
    rows, columns = x.shape
    _kernel("add_layer_norm", x.dtype)(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr(),
        out.data_ptr(),
        rows,
        columns,
        eps,
        torch.get_num_threads(),
    )
    return out


def _normalize(
    name: str, x: torch.Tensor, second: int, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    """Runs one of the two norm kernels, whose second argument is x's row stride (rms_norm) or
    the residual's address (add_rms_norm)."""
    rows, columns = x.shape
    threads = torch.get_num_threads()
    _kernel(name, x.dtype)(
        x.data_ptr(), second, weight.data_ptr(), out.data_ptr(), rows, columns, eps, threads
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for rows [gate | up] of gate_up [rows, 2 * n]: a new [rows, n]."""
    _rows("silu_and_mul", gate_up)
    _check("silu_and_mul", gate_up.shape[1] % 2 == 0, "needs an even number of columns")
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype)
    _kernel("silu_and_mul", gate_up.dtype)(
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        gate_up.shape[0],
        n,
        torch.get_num_threads(),
    )
    return out


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings of q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim]
    (views into a fused projection are fine: heads contiguous within a token) with cos and sin
    [tokens, 1, head_dim // 2] sharing one token stride; new contiguous q and k."""
    for name, x in (("q", q), ("k", k)):
        _on_cpu("rotary_qk", x)
        _check("rotary_qk", x.dim() == 3, f"{name} must be [tokens, heads, head_dim]")
        _check("rotary_qk", heads_side_by_side(x), f"{name} heads")
    num_tokens, _, head_dim = q.shape
    half_dim = head_dim // 2
    same_layout = k.shape[0] == num_tokens and k.shape[2] == head_dim and k.dtype == q.dtype
    _check("rotary_qk", same_layout, "q and k differ")
    for name, x in (("cos", cos), ("sin", sin)):
        _check("rotary_qk", x.dtype == q.dtype and x.shape == (num_tokens, 1, half_dim), name)
        _check("rotary_qk", x.stride(2) == 1 and x.stride(0) == cos.stride(0), f"{name} strides")
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    _kernel("rotary_qk", q.dtype)(
        q.data_ptr(),
        q.stride(0),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        q_out.data_ptr(),
        k_out.data_ptr(),
        num_tokens,
        head_dim,
        torch.get_num_threads(),
    )
    return q_out, k_out
