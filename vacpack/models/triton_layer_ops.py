"""A decoder layer's elementwise ops as fused Triton kernels, for GPUs.

PyTorch runs an RMSNorm as seven kernels (float32 copy, square, mean, add, rsqrt, multiply,
weight), the residual add as one more, SiLU(gate) * up as two and the rotary embedding of q and
k as a dozen: each reads and writes the whole activation. Here each op is one kernel and one
pass over memory, which matters twice over: a prefill step moves less memory, and a decode
step's CUDA graph holds a fifth of the nodes, so replaying it costs the host less.

Each kernel rounds where PyTorch's ops round (the sum to the activation dtype before the norm,
the normalized row before the weight, each product of the rotary before the sum), so outputs
match `LayerOps` up to the order of the mean's additions. Which implementation each op runs is
measured at load on the model's shapes (layer_ops_choice.py); shapes the kernels do not take
(per-head norms over strided views) go to PyTorch's ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vacpack.models.layer_ops import LayerOps

SILU_BLOCK = 1024


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read and overwritten with x + residual; only with HAS_RESIDUAL
    weight_ptr,
    out_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    num_columns,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    valid = columns < num_columns
    x = tl.load(x_ptr + row * x_row_stride + columns, valid, 0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * residual_row_stride + columns
        # The sum in the activation dtype, as PyTorch's `x + residual` leaves it.
        x = (x.to(tl.float32) + tl.load(residual_row, valid, 0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual_row, x, valid)
    x_float = x.to(tl.float32)
    mean_square = tl.sum(x_float * x_float, 0) / num_columns
    normalized = (x_float * tl.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + columns, valid, 0.0)
    out = (normalized.to(tl.float32) * weight.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * out_row_stride + columns, out, valid)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, gate_up_row_stride, out_row_stride, width, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = columns < width
    gate = tl.load(gate_up_ptr + row * gate_up_row_stride + columns, valid, 0.0)
    up = tl.load(gate_up_ptr + row * gate_up_row_stride + width + columns, valid, 0.0)
    gate_float = gate.to(tl.float32)
    silu = (gate_float * tl.sigmoid(gate_float)).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * out_row_stride + columns, out, valid)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    q_token_stride,
    k_token_stride,
    cos_sin_token_stride,
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # half the rotated dimensions
    HALF_BLOCK: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,  # dimensions past the rotated ones (partial rotary), or 0
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        source = q_ptr + token * q_token_stride + head * HEAD_DIM
        target = q_out_ptr + (token * num_q_heads + head) * HEAD_DIM
    else:
        num_k_heads = tl.num_programs(1) - num_q_heads
        k_head = head - num_q_heads
        source = k_ptr + token * k_token_stride + k_head * HEAD_DIM
        target = k_out_ptr + (token * num_k_heads + k_head) * HEAD_DIM
    dims = tl.arange(0, HALF_BLOCK)
    valid = dims < HALF
    x1 = tl.load(source + dims, valid, 0.0)
    x2 = tl.load(source + HALF + dims, valid, 0.0)
    cos = tl.load(cos_ptr + token * cos_sin_token_stride + dims, valid, 0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * cos_sin_token_stride + dims, valid, 0.0).to(tl.float32)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # Each product rounded to the activation dtype before the sum, as PyTorch computes it.
    x1_cos, x2_sin = (x1 * cos).to(dtype).to(tl.float32), (x2 * sin).to(dtype).to(tl.float32)
    x2_cos, x1_sin = (x2 * cos).to(dtype).to(tl.float32), (x1 * sin).to(dtype).to(tl.float32)
    tl.store(target + dims, (x1_cos - x2_sin).to(dtype), valid)
    tl.store(target + HALF + dims, (x2_cos + x1_sin).to(dtype), valid)
    if TAIL_BLOCK > 0:
        tail = 2 * HALF + tl.arange(0, TAIL_BLOCK)
        tail_valid = tail < HEAD_DIM
        tl.store(target + tail, tl.load(source + tail, tail_valid, 0.0), tail_valid)


class TritonLayerOps(LayerOps):
    """One fused Triton kernel per op; layouts they do not take go to PyTorch's ops."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] == 0:
            return super().rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        self._norm(x, x, weight, out, eps, has_residual=False)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum is written into `residual` in place."""
        if (
            x.dim() != 2
            or x.stride(1) != 1
            or residual.stride(1) != 1
            or residual.shape != x.shape
            or x.shape[0] == 0
        ):
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty_like(x)
        self._norm(x, residual, weight, out, eps, has_residual=True)
        return out, residual

    @staticmethod
    def _norm(
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
        *,
        has_residual: bool,
    ) -> None:
        num_rows, num_columns = x.shape
        block = triton.next_power_of_2(num_columns)
        _rms_norm_kernel[(num_rows,)](
            x,
            residual,
            weight,
            out,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            num_columns,
            eps,
            HAS_RESIDUAL=has_residual,
            BLOCK=block,
            num_warps=_norm_warps(block),
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[0] == 0:
            return super().silu_and_mul(gate_up)
        num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
        grid = (num_rows, triton.cdiv(width, SILU_BLOCK))
        _silu_and_mul_kernel[grid](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=SILU_BLOCK
        )
        return out

    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New contiguous q and k; q and k may be views into a fused projection's rows."""
        cos, sin = cos_sin
        num_tokens, num_q_heads, head_dim = q.shape
        half = cos.shape[-1]
        if not (
            _heads_contiguous(q)
            and _heads_contiguous(k)
            and k.shape[0] == num_tokens
            and k.shape[2] == head_dim
            and cos.dim() == 3
            and cos.stride(2) == 1
            and sin.stride(2) == 1
            and cos.stride(0) == sin.stride(0)
            and num_tokens > 0
        ):
            return super().rotary_qk(q, k, cos_sin)
        q_out, k_out = (
            torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
        )
        tail = head_dim - 2 * half
        _rotary_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q,
            k,
            q_out,
            k_out,
            cos,
            sin,
            q.stride(0),
            k.stride(0),
            cos.stride(0),
            num_q_heads,
            HEAD_DIM=head_dim,
            HALF=half,
            HALF_BLOCK=triton.next_power_of_2(half),
            TAIL_BLOCK=triton.next_power_of_2(tail) if tail > 0 else 0,
        )
        return q_out, k_out


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads one after another (a view into a fused
    projection's row is fine)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
