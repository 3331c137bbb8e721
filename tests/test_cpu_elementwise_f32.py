"""The fused float32 C kernels (elementwise_f32.c, any CPU with a C compiler) against the
PyTorch ops they replace, and float32 models with them against the same models without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vacpack import LLM, SamplingParams
from vacpack.cpu_kernels.elementwise import (
    add_layer_norm,
    add_rms_norm,
    elementwise_kernels_available,
    rms_norm,
    rotary_qk,
    silu_and_mul,
)
from vacpack.models.layer_ops import CpuKernelLayerOps, LayerOps, select_layer_ops
from vacpack.models.norm import RMSNorm
from vacpack.models.rotary import RopeSettings, RotaryEmbedding, apply_rotary
from vacpack.testing.layer_ops import layer_ops_holders, set_layer_ops
from vacpack.testing.packed_forward import load_for_test, packed_forward
from vacpack.testing.tiny_encoders import minilm_dir

CPU = torch.device("cpu")
F32 = torch.float32
pytestmark = pytest.mark.skipif(
    not elementwise_kernels_available(CPU, F32), reason="needs a C compiler"
)
# Sums in another order, contracted products and a polynomial exp: a few float32 ulps.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def _torch_norm(hidden_size: int, weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(hidden_size, eps)
    norm.weight.data = weight
    return norm  # built outside use_layer_ops: the PyTorch ops


@pytest.mark.parametrize("hidden_size", [896, 100, 7])
def test_rms_norm_equals_pytorch_on_strided_rows(hidden_size: int) -> None:
    generator = torch.Generator().manual_seed(hidden_size)
    wide = torch.randn(67, hidden_size + 9, generator=generator) * 3
    x = wide[:, :hidden_size]  # strided rows, as a view into a wider tensor
    weight = torch.rand(hidden_size, generator=generator) + 0.5
    reference = _torch_norm(hidden_size, weight, 1e-6)(x)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), reference, **TOLERANCE)


@pytest.mark.parametrize("hidden_size", [896, 100, 7])
def test_add_rms_norm_updates_the_residual_in_place(hidden_size: int) -> None:
    generator = torch.Generator().manual_seed(hidden_size + 1)
    x = torch.randn(33, hidden_size, generator=generator) * 2
    residual = torch.randn(33, hidden_size, generator=generator)
    weight = torch.rand(hidden_size, generator=generator) + 0.5
    expected_sum = x + residual
    reference, _ = _torch_norm(hidden_size, weight, 1e-5).add_and_norm(x, residual.clone())
    out, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert summed.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(out, reference, **TOLERANCE)


@pytest.mark.parametrize("hidden_size", [384, 100, 7])
def test_add_layer_norm_equals_pytorch(hidden_size: int) -> None:
    """Rows far from zero mean too (the first five): there the kernel's mean, corrected from
    the deviations, and its variance, taken about it, stay as close to float64's as
    PyTorch's."""
    generator = torch.Generator().manual_seed(hidden_size + 2)
    x = torch.randn(41, hidden_size, generator=generator) * 2
    residual = torch.randn(41, hidden_size, generator=generator)
    residual[:5] += 1000.0
    weight = torch.rand(hidden_size, generator=generator) + 0.5
    bias = torch.randn(hidden_size, generator=generator)
    reference = F.layer_norm(x + residual, (hidden_size,), weight, bias, 1e-12)
    out = add_layer_norm(x, residual, weight, bias, 1e-12)
    torch.testing.assert_close(out[5:], reference[5:], rtol=1e-5, atol=1e-5)
    exact = F.layer_norm(
        (x + residual).double(), (hidden_size,), weight.double(), bias.double(), 1e-12
    )
    error, reference_error = [(y.double() - exact)[:5].abs().max().item() for y in (out, reference)]
    assert error <= 1.5 * reference_error + 1e-6
    assert torch.equal(LayerOps().add_layer_norm(x, residual, weight, bias, 1e-12), reference)
    with pytest.raises(ValueError, match="bad bias"):
        add_layer_norm(x, residual, weight, bias[:-1], 1e-12)


@pytest.mark.parametrize("width", [4864, 100, 7])
def test_silu_and_mul_equals_pytorch(width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = torch.randn(19, 2 * width, generator=generator) * 4
    specials = [-200.0, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 100.0, 1e-30]
    row = torch.tensor(specials * (width // len(specials) + 1))[:width]
    gate_up[0, :width] = row
    gate_up[0, width:] = 1.0
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **TOLERANCE)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_equals_pytorch_on_views_of_the_projection(head_dim: int) -> None:
    num_tokens, num_heads, num_kv_heads = 37, 6, 2
    generator = torch.Generator().manual_seed(head_dim)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(widths), generator=generator)
    q, k, _ = qkv.split(widths, dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    rotary = RotaryEmbedding(RopeSettings(head_dim, 10000.0, None, 4096))
    rotary.build_cache(CPU, F32)
    cos_sin = rotary.cos_sin_for(torch.randint(0, 4096, (num_tokens,), generator=generator))
    q_out, k_out = rotary_qk(q, k, *cos_sin)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    torch.testing.assert_close(q_out, apply_rotary(q, cos_sin), **TOLERANCE)
    torch.testing.assert_close(k_out, apply_rotary(k, cos_sin), **TOLERANCE)


def test_q_and_k_in_different_dtypes_are_refused() -> None:
    q = torch.randn(3, 2, 8)
    cos = torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="q and k differ"):
        rotary_qk(q, q.to(torch.bfloat16), cos, cos)


def _fused(model: torch.nn.Module) -> bool:
    return all(isinstance(getattr(m, a), CpuKernelLayerOps) for m, a in layer_ops_holders(model))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_a_float32_model_with_the_kernels_matches_itself_without(tiny_checkpoint, family) -> None:
    assert isinstance(select_layer_ops(CPU, F32), CpuKernelLayerOps)
    model = load_for_test(tiny_checkpoint(family), F32)
    assert _fused(model)
    sequences = [list(range(3, 3 + n)) for n in (1, 17, 60, 5)]
    fused = packed_forward(model, sequences)
    set_layer_ops(model, LayerOps)
    unfused = packed_forward(model, sequences)
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


def test_greedy_generation_is_unchanged_by_the_kernels(tiny_checkpoint) -> None:
    llm = LLM(
        str(tiny_checkpoint("qwen2")), dtype="float32", block_size=8, enable_prefix_caching=False
    )
    prompts = [" ".join(["word"] * n) + " end" for n in (1, 9, 40, 120)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert set_layer_ops(llm.loaded.model, CpuKernelLayerOps) > 0
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    set_layer_ops(llm.loaded.model, LayerOps)
    unfused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == unfused


def test_an_encoders_embeddings_are_unchanged_by_the_kernel() -> None:
    llm = LLM(str(minilm_dir()), dtype="float32")
    texts = ["a", "a short text", " ".join(["longer"] * 90)]
    assert set_layer_ops(llm.loaded.model, CpuKernelLayerOps) == 13  # embeddings + 2 a layer
    fused = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    set_layer_ops(llm.loaded.model, LayerOps)
    unfused = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
