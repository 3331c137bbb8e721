"""bf16 linear layers through vacpack's VDPBF16PS kernel (gemm_bf16.c): what F.linear computes
to bf16 rounding at every edge of its blocking (rows, panels, an odd reduction), a gated MLP
finished in the kernel, the model's layers and a whole model on it, and its place among the
measured choice's candidates. Timings are injected through a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from asan_build import worst_difference_under_asan
from fake_clock import FakeClock
from transformers import AutoModelForCausalLM

from vacpack import LLM, SamplingParams
from vacpack.cpu_kernels.gemm import GemmWeight, gemm_linear, gemm_supported, pack_weight
from vacpack.models import linear_choice
from vacpack.models.cpu_prepack import packed_linear
from vacpack.models.linear_choice import (
    LinearTiming,
    choose_linear_kernel,
    eligible_linear_kernels,
)
from vacpack.models.parallel import (
    SINGLE_RANK,
    ColumnParallelLinear,
    GateUpParallelLinear,
    LMHead,
    RowParallelLinear,
)
from vacpack.tuning import ChoiceSource, force_env_var

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(
    not gemm_supported(BF16, BF16),
    reason="the bf16 C kernel needs an AVX512-BF16 CPU and a C compiler",
)
CPU = torch.device("cpu")
# Rows around the 8-, 4-, 2- and 1-row blocks; output features around 16-feature panels and
# 3-panel blocks split over two threads; reductions odd and even.
SHAPES = [
    (1, 896, 1152), (2, 64, 16), (3, 63, 40), (5, 33, 17), (8, 128, 48),
    (13, 127, 897), (64, 96, 100),
]  # fmt: skip


def assert_bf16_close(ours: torch.Tensor, exact: torch.Tensor) -> None:
    """Ours is rounded to bf16 once, from float32 sums in another order than the reference's:
    within two of bf16's steps of the exact value (plus a little for sums that cancel)."""
    assert ours.dtype == BF16
    scale = exact.abs().max().item()
    torch.testing.assert_close(ours.float(), exact, rtol=2**-7, atol=1e-3 * scale)


def random_bf16(*shape: int, generator: torch.Generator, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * std).to(BF16)


@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_computes_what_f_linear_computes(
    rows: int, in_features: int, out_features: int, with_bias: bool, threads: int
) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = random_bf16(rows, in_features, generator=generator)
    weight = random_bf16(out_features, in_features, generator=generator, std=0.1)
    bias = random_bf16(out_features, generator=generator) if with_bias else None
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = pack_weight(weight, arithmetic=BF16)
        assert packed.arithmetic == BF16 and packed.panels.dtype == BF16
        assert_bf16_close(gemm_linear(x, packed, bias), exact)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("rows,in_features,intermediate", [(1, 64, 16), (7, 33, 40), (70, 96, 56)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_gated_projection_is_finished_as_its_outputs_are_written(
    rows: int, in_features: int, intermediate: int, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(intermediate)
    x = random_bf16(rows, in_features, generator=generator)
    gate_up = random_bf16(2 * intermediate, in_features, generator=generator, std=0.2)
    bias = random_bf16(2 * intermediate, generator=generator) if with_bias else None
    gate, up = F.linear(x.float(), gate_up.float(), None if bias is None else bias.float()).chunk(
        2, dim=-1
    )
    packed = pack_weight(gate_up, "silu", arithmetic=BF16)
    assert packed.out_features == intermediate and packed.gated_by == "silu"
    assert_bf16_close(gemm_linear(x, packed, bias), F.silu(gate) * up)


def test_only_silu_gates_in_the_bf16_kernel() -> None:
    with pytest.raises(ValueError, match="gated by 'gelu_pytorch_tanh'"):
        pack_weight(torch.zeros(32, 16, dtype=BF16), "gelu_pytorch_tanh", arithmetic=BF16)


def test_an_odd_reduction_never_reads_past_a_row() -> None:
    """Rows of 63 inputs, each followed in memory by a NaN: the 64th input of the last pair
    is a zero of the kernel's own, since NaN x 0 would be NaN."""
    generator = torch.Generator().manual_seed(5)
    wide = random_bf16(9, 64, generator=generator)
    wide[:, 63] = float("nan")
    x = wide[:, :63]
    weight = random_bf16(20, 63, generator=generator, std=0.1)
    out = gemm_linear(x, pack_weight(weight, arithmetic=BF16))
    assert torch.isfinite(out).all()
    assert_bf16_close(out, F.linear(x.float(), weight.float()))


def test_inputs_with_leading_dimensions_strides_or_no_rows() -> None:
    generator = torch.Generator().manual_seed(6)
    weight = random_bf16(24, 32, generator=generator, std=0.1)
    packed = pack_weight(weight, arithmetic=BF16)
    x = random_bf16(2, 3, 32, generator=generator)
    assert_bf16_close(gemm_linear(x, packed), F.linear(x.float(), weight.float()))
    columns = random_bf16(5, 48, generator=generator)[:, 8:40]  # rows 48 apart
    assert_bf16_close(gemm_linear(columns, packed), F.linear(columns.float(), weight.float()))
    assert gemm_linear(torch.empty(0, 32, dtype=BF16), packed).shape == (0, 24)
    with pytest.raises(ValueError, match=r"takes torch\.bfloat16 inputs"):
        gemm_linear(torch.randn(3, 32), packed)
    # The kernel applies no activation itself: the packed layer runs it after.
    assert_bf16_close(
        packed_linear(x, packed, None, "gelu"), F.gelu(F.linear(x.float(), weight.float()))
    )


def test_the_model_layers_run_on_the_kernel_and_keep_only_its_copy() -> None:
    generator = torch.Generator().manual_seed(2)
    column = ColumnParallelLinear(48, [32, 16, 16], bias=True).to(BF16)
    row = RowParallelLinear(64, 48, bias=True).to(BF16)
    head = LMHead(100, 32).to(BF16)
    silu_mlp = GateUpParallelLinear(48, 24, "silu", SINGLE_RANK).to(BF16)
    gelu_mlp = GateUpParallelLinear(48, 24, "gelu_pytorch_tanh", SINGLE_RANK).to(BF16)
    for layer in (column, row, head, silu_mlp, gelu_mlp):
        for parameter in layer.parameters():
            parameter.data.copy_(random_bf16(*parameter.shape, generator=generator, std=0.1))
    x = random_bf16(7, 48, generator=generator)
    row_x = random_bf16(7, 64, generator=generator)
    hidden = random_bf16(5, 32, generator=generator)
    expected_column = F.linear(x.float(), column.weight.float(), column.bias.float())
    expected_row = F.linear(row_x.float(), row.weight.float(), row.bias.float())
    expected_head = F.linear(hidden.float(), head.weight.float())
    silu_gate, silu_up = F.linear(x.float(), silu_mlp.weight.float()).chunk(2, dim=-1)
    gelu_gate_up = F.linear(x.float(), gelu_mlp.weight.float())

    for layer in (column, row, head, silu_mlp, gelu_mlp):
        layer.prepack_for_cpu("c_gemm_bf16")
        assert isinstance(layer.packed_weight, GemmWeight)
        assert layer.packed_weight.arithmetic == BF16 and layer.weight.is_meta

    assert_bf16_close(column(x), expected_column)
    assert_bf16_close(row(row_x), expected_row)
    assert_bf16_close(head.project(hidden), expected_head)
    # SiLU is finished in the kernel; a tanh GELU gate is not: that layer returns [gate | up].
    assert silu_mlp.gates_itself and not gelu_mlp.gates_itself
    assert_bf16_close(silu_mlp(x), F.silu(silu_gate) * silu_up)
    assert_bf16_close(gelu_mlp(x), gelu_gate_up)


def test_the_bf16_kernel_is_a_candidate_for_bf16_linears_only() -> None:
    assert eligible_linear_kernels(CPU, BF16) == ["onednn", "c_gemm_bf16"]
    assert "c_gemm_bf16" not in eligible_linear_kernels(CPU, torch.float32)
    # bfloat16 weights under float32 arithmetic: the float32 kernel's case.
    assert eligible_linear_kernels(CPU, torch.float32, BF16) == ["c_gemm"]


@pytest.mark.parametrize(
    "onednn_s,c_gemm_bf16_s,chosen",
    [(0.010, 0.009, "c_gemm_bf16"), (0.010, 0.0099, "onednn"), (0.009, 0.010, "onednn")],
)
def test_the_faster_kernel_is_chosen_and_onednn_keeps_near_ties(
    tmp_path: Path, onednn_s: float, c_gemm_bf16_s: float, chosen: str
) -> None:
    clock = FakeClock()
    timing = LinearTiming(16, 64, BF16, (4,))
    candidates = {"onednn": clock.costing(onednn_s), "c_gemm_bf16": clock.costing(c_gemm_bf16_s)}
    kernel, choice = choose_linear_kernel(
        CPU, timing, candidates=candidates, cache_dir=tmp_path, clock=clock
    )
    assert kernel == chosen and choice is not None
    assert set(choice.best_time_s) == {"onednn", "c_gemm_bf16"}


def test_both_candidates_compute_the_same_gated_layer() -> None:
    timing = LinearTiming(32, 48, BF16, (5,), gated_by="silu")
    calls = linear_choice.linear_calls(timing, ["onednn", "c_gemm_bf16"], num_copies=2)
    for call in calls.values():
        call()  # each runs its layer, the gate included, without raising


# A gated MLP with SiLU (Qwen2, finished in the kernel) and with tanh GELU (Gemma 2, the
# model's own pass after it).
@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_a_bf16_model_on_the_kernel_matches_transformers(
    family: str, tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(force_env_var(linear_choice.PHASE), "c_gemm_bf16")
    model_dir = tiny_checkpoint(family)
    llm = LLM(str(model_dir), dtype="bfloat16", block_size=8, max_num_batched_tokens=64)
    choices = [c for c in llm.loaded.measured_choices if c.phase == linear_choice.PHASE]
    assert choices and all(
        c.chosen == "c_gemm_bf16" and c.source is ChoiceSource.FORCED_ENV for c in choices
    )
    model = llm.loaded.model
    assert isinstance(model.lm_head.packed_weight, GemmWeight)
    gate_ups = [m for m in model.modules() if isinstance(m, GateUpParallelLinear)]
    assert gate_ups and all(m.gates_itself == (family == "qwen2") for m in gate_ups)

    generator = torch.Generator().manual_seed(0)
    vocab_size = llm.loaded.config.vocab_size
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (3, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], -1)
        for position in range(1, len(prompt)):
            token = prompt[position]
            ours = output.prompt_logprobs[position][token].logprob
            # bf16 activations against a float32 reference: oneDNN's bf16 path and this
            # kernel's both differ by up to ~0.11 on these models.
            assert ours == pytest.approx(float(logprobs[position - 1, token]), abs=0.25)


# Every edge under AddressSanitizer, in tensors without slack: rows of 1, 5 and 13 (blocks of
# 1, 4 and 8 rows and a remainder), odd and even reductions, 17 and 40 output features (a
# partial panel, a partial group), a gated projection, a bias, two threads.
ASAN_SCRIPT = """
import ctypes, sys
import torch
import torch.nn.functional as F
from vacpack.cpu_kernels import gemm, gemm_bf16

library = ctypes.CDLL(sys.argv[1])
pack, run = library.pack_weight_bf16_pairs, library.gemm_bf16
P, I = ctypes.c_void_p, ctypes.c_int64
pack.argtypes = [P, I, I, I, P, ctypes.c_int]
run.argtypes = [P, I, I, I, P, I, P, ctypes.c_int, P, I, ctypes.c_int]
run.restype = ctypes.c_int
gemm_bf16._pack_kernel = lambda: pack
gemm_bf16._gemm_kernel = lambda: run
torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
worst = 0.0
for rows, inputs, outputs, gated in [(1, 63, 17, False), (5, 64, 40, True), (13, 33, 17, True),
                                     (13, 127, 40, False)]:
    x = torch.randn(rows, inputs, generator=generator).bfloat16()
    weight = (torch.randn((2 if gated else 1) * outputs, inputs, generator=generator) * 0.1)
    weight = weight.bfloat16()
    bias = torch.randn(weight.shape[0], generator=generator).bfloat16()
    packed = gemm.pack_weight(weight, "silu" if gated else None, torch.bfloat16)
    out = gemm.gemm_linear(x, packed, bias).float()
    exact = F.linear(x.float(), weight.float(), bias.float())
    if gated:
        gate, up = exact.chunk(2, dim=-1)
        exact = F.silu(gate) * up
    worst = max(worst, ((out - exact).abs() / (exact.abs().max() + 1e-6)).max().item())
print("worst difference", worst)
"""


def test_every_edge_stays_in_bounds_under_asan(tmp_path: Path) -> None:
    worst = worst_difference_under_asan(tmp_path, "gemm_bf16", "VACPACK_ASAN=1", ASAN_SCRIPT)
    assert worst < 2**-6
