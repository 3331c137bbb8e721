"""Linear weights prepacked for oneDNN on a CPU: the same numbers as F.linear, less memory kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vacpack import LLM, SamplingParams
from vacpack.models import cpu_prepack, linear_choice
from vacpack.models.parallel import (
    ColumnParallelLinear,
    LMHead,
    RowParallelLinear,
    VocabEmbedding,
)
from vacpack.tuning import force_env_var

pytestmark = pytest.mark.skipif(
    not cpu_prepack.can_prepack(torch.empty(1, dtype=torch.bfloat16)),
    reason="oneDNN cannot pack bf16 weights on this CPU",
)


def _filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for parameter in layer.parameters():
        parameter.data.normal_(std=0.05, generator=generator)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 600])
def test_packed_layers_compute_what_f_linear_computes(dtype: torch.dtype, num_rows: int) -> None:
    column = _filled(ColumnParallelLinear(48, [32, 16, 16], bias=True), seed=1).to(dtype)
    row = _filled(RowParallelLinear(64, 48, bias=True), seed=2).to(dtype)
    x = torch.randn(num_rows, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    expected_column = F.linear(x, column.weight, column.bias)
    expected_row = F.linear(expected_column, row.weight, row.bias)

    column.prepack_for_cpu()
    row.prepack_for_cpu()

    assert column.packed_weight is not None and row.packed_weight is not None
    # The plain weights are gone (meta), their shapes kept for anyone who asks.
    assert column.weight.is_meta and column.weight.shape == (64, 48)
    assert row.weight.is_meta and row.weight.shape == (48, 64)
    out_column = column(x)
    # bf16 products are bit for bit the same; fp32 may sum in another order.
    tolerance = {"atol": 0.0, "rtol": 0.0} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out_column, expected_column, **tolerance)
    torch.testing.assert_close(row(out_column), expected_row, **tolerance)
    # Leading dimensions work as with F.linear.
    assert column(x.view(1, num_rows, 48)).shape == (1, num_rows, 64)


def test_a_tied_table_stays_for_lookups_and_an_untied_head_drops_it() -> None:
    tied = _filled(VocabEmbedding(100, 32), seed=4).to(torch.bfloat16)
    untied = _filled(LMHead(100, 32), seed=5).to(torch.bfloat16)
    hidden = torch.randn(5, 32).to(torch.bfloat16)
    expected_tied, expected_untied = tied.project(hidden), untied.project(hidden)
    token_ids = torch.tensor([3, 99, 0])
    expected_rows = tied(token_ids)

    tied.prepack_for_cpu()
    untied.prepack_for_cpu()

    assert not tied.weight.is_meta and untied.weight.is_meta
    torch.testing.assert_close(tied(token_ids), expected_rows, atol=0.0, rtol=0.0)
    torch.testing.assert_close(tied.project(hidden), expected_tied, atol=0.0, rtol=0.0)
    torch.testing.assert_close(untied.project(hidden), expected_untied, atol=0.0, rtol=0.0)


def test_the_switch_keeps_plain_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_prepack.DISABLE_ENV, "0")
    layer = _filled(ColumnParallelLinear(16, [8], bias=False), seed=6)
    layer.prepack_for_cpu()
    assert layer.packed_weight is None and not layer.weight.is_meta


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied LM heads
def test_a_loaded_model_is_packed_and_generates_the_same_tokens(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    model_dir = str(tiny_checkpoint(family))
    # oneDNN on the packed weights: its numbers are F.linear's bit for bit (the bf16 C kernel,
    # also a candidate on AVX512-BF16 CPUs, rounds differently: test_cpu_gemm_bf16.py).
    monkeypatch.setenv(force_env_var(linear_choice.PHASE), "onednn")
    prompts = [[5, 17, 99, 3], list(range(40, 90)), [7] * 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    packed = LLM(model_dir, dtype="bfloat16", block_size=8)
    model = packed.loaded.model
    assert model.layers[0].mlp.gate_up_proj.packed_weight is not None
    assert model.layers[0].self_attn.o_proj.weight.is_meta
    assert model.lm_head.packed_weight is not None
    packed_outputs = packed.generate(prompts, params, use_tqdm=False)

    monkeypatch.setenv(cpu_prepack.DISABLE_ENV, "0")
    plain = LLM(model_dir, dtype="bfloat16", block_size=8)
    assert plain.loaded.model.layers[0].mlp.gate_up_proj.packed_weight is None
    plain_outputs = plain.generate(prompts, params, use_tqdm=False)

    for ours, reference in zip(packed_outputs, plain_outputs, strict=True):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
        assert ours.outputs[0].logprobs == reference.outputs[0].logprobs
