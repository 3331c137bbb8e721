"""The fused Triton layer ops equal PyTorch's (`LayerOps`), on a GPU or in Triton's interpreter.

Within one unit in the last place of the activation dtype: the norms' means add in another
order, SiLU is computed through a sigmoid, and Triton's interpreter truncates float32 to
bfloat16 where a GPU (and PyTorch) rounds to nearest.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_marks import TRITON_RUNS

pytest.importorskip("triton")
pytestmark = TRITON_RUNS

from vacpack.attention import BatchLayout, create_backend  # noqa: E402
from vacpack.models import triton_layer_ops  # noqa: E402
from vacpack.models.forward_context import ForwardContext  # noqa: E402
from vacpack.models.layer_ops import LayerOps, eligible_layer_ops  # noqa: E402
from vacpack.models.loader import load_hf_config, load_model  # noqa: E402
from vacpack.models.triton_layer_ops import TritonLayerOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
REFERENCE = LayerOps()
TRITON = TritonLayerOps()


def _random(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


def _close(dtype: torch.dtype) -> dict[str, float]:
    """One unit in the last place: 2^-7 of the value in bfloat16 (8 significant bits). In the
    interpreter each of an op's roundings to bfloat16 may truncate instead, which compounds and,
    in the rotary's differences, cancels: there bfloat16 checks only the plumbing, and the
    float32 cases check the arithmetic."""
    if dtype == torch.float32:
        return {"atol": 1e-6, "rtol": 1e-6}
    if DEVICE.type == "cuda":
        return {"atol": 1e-6, "rtol": 2**-7}
    return {"atol": 0.1, "rtol": 0.05}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 200])
def test_rms_norm_and_add_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    rows = 7
    # Rows of a wider buffer: the kernels take strided rows.
    x = _random(rows, hidden + 8, dtype=dtype)[:, :hidden]
    weight = _random(hidden, dtype=dtype, seed=1)
    torch.testing.assert_close(
        TRITON.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6), **_close(dtype)
    )
    residual = _random(rows, hidden, dtype=dtype, seed=2)
    want_out, want_sum = REFERENCE.add_rms_norm(x, residual.clone(), weight, 1e-6)
    in_place = residual.clone()
    out, summed = TRITON.add_rms_norm(x, in_place, weight, 1e-6)
    torch.testing.assert_close(summed, want_sum, **_close(dtype))
    assert summed.data_ptr() == in_place.data_ptr()  # the sum went into the residual
    torch.testing.assert_close(out, want_out, **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = _random(5, 2 * 1100, dtype=dtype)  # past one block of columns
    torch.testing.assert_close(
        TRITON.silu_and_mul(gate_up), REFERENCE.silu_and_mul(gate_up), **_close(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full, and partial (the rest passes through)
def test_rotary_qk_on_views_of_a_fused_projection(dtype: torch.dtype, rotary_dim: int) -> None:
    tokens, q_heads, kv_heads, head_dim = 6, 4, 2, 16
    qkv = _random(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)
    cos_sin = _random(tokens, rotary_dim, dtype=dtype, seed=3)  # as the model gathers them
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    got_q, got_k = TRITON.rotary_qk(q, k, (cos, sin))
    want_q, want_k = REFERENCE.rotary_qk(q, k, (cos, sin))
    torch.testing.assert_close(got_q, want_q, **_close(dtype))
    torch.testing.assert_close(got_k, want_k, **_close(dtype))


def test_layouts_the_kernels_do_not_take_go_to_pytorch() -> None:
    """Qwen3's per-head norms run over [tokens, heads, head_dim]: PyTorch's ops, same result."""
    x = _random(3, 4, 16, dtype=torch.float32)
    weight = _random(16, dtype=torch.float32, seed=1)
    torch.testing.assert_close(
        TRITON.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6)
    )


def test_eligible_on_cuda_only() -> None:
    assert "triton" not in eligible_layer_ops(torch.device("cpu"), torch.bfloat16)
    assert "triton" in eligible_layer_ops(torch.device("cuda"), torch.bfloat16)


class CountedLaunches:
    """Stands in for a Triton kernel: counts its launches and runs it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_a_model_built_with_them_computes_what_pytorch_ops_compute(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """Whole layers: the fused norms, activation and rotary where they apply (Qwen3's per-head
    norms and Phi-3's fused projections included), PyTorch's ops elsewhere."""
    model_dir = tiny_checkpoint(family)
    config = load_hf_config(model_dir)
    reference = load_model(model_dir, config, torch.float32, DEVICE, LayerOps())
    fused = load_model(model_dir, config, torch.float32, DEVICE, TritonLayerOps())
    kernels = {}
    for name in ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel"):
        kernels[name] = CountedLaunches(getattr(triton_layer_ops, name))
        monkeypatch.setattr(triton_layer_ops, name, kernels[name])
    lengths = [5, 11]
    token_ids = torch.randint(0, 1000, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    backend = create_backend("torch_sdpa")
    metadata = backend.build_metadata(BatchLayout(lengths, lengths), DEVICE)
    with torch.inference_mode():
        want, got = (
            model(
                token_ids.to(DEVICE), positions.to(DEVICE), ForwardContext(backend, metadata, None)
            )
            for model in (reference, fused)
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    layers = config.num_hidden_layers
    launches = {name: kernel.launches for name, kernel in kernels.items()}
    # Every layer's two norms and the final one (Qwen3's per-head q/k norms are PyTorch's).
    assert launches == {
        "_rms_norm_kernel": 2 * layers + 1,
        "_silu_and_mul_kernel": layers,
        "_rotary_kernel": layers,
    }
