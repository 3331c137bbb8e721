"""float32 linear layers through vacpack's C kernel (gemm_f32.c): the numbers F.linear computes,
at every shape its blocking has an edge in, inside the model's layers and a whole model; and
the measured choice between it and oneDNN. Timings are injected through a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fake_clock import FakeClock
from transformers import AutoModelForCausalLM

from vacpack import LLM, SamplingParams
from vacpack.config import EngineConfig
from vacpack.cpu_kernels.elementwise import silu_and_mul
from vacpack.cpu_kernels.gemm import GemmWeight, gemm_linear, gemm_supported, pack_weight
from vacpack.host_memory import largest_cpu_cache_bytes
from vacpack.models import linear_choice
from vacpack.models.activations import ACTIVATIONS
from vacpack.models.linear_choice import (
    LinearKernelChooser,
    LinearTiming,
    ModelLinears,
    choose_linear_kernel,
    linear_calls,
    timed_out_features,
)
from vacpack.models.parallel import (
    SINGLE_RANK,
    ColumnParallelLinear,
    GateUpParallelLinear,
    LMHead,
    RowParallelLinear,
    VocabEmbedding,
)
from vacpack.runtime import load
from vacpack.tuning import ChoiceSource, force_env_var

pytestmark = pytest.mark.skipif(
    not gemm_supported(torch.float32), reason="the C kernels do not build here (no C compiler)"
)
CPU = torch.device("cpu")
TIMING = LinearTiming(16, 64, torch.float32, (4, 8))


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    bias64 = bias.double() if bias is not None else None
    return F.linear(x.double(), weight.double(), bias64).float()


# (rows, in, out): every row count of a short panel (1 to 5 rows: the product loop is built once
# per count) and around the 6-row register block; output features that are not a multiple of
# the 16-feature panel; reductions in one slice, in two and three slices of at most 1,024 (the
# last shorter), of whole eights of steps and not (the packing transposes eight steps at a
# time); and inputs too large to pack whole (the blocked order, 180-row blocks and a ragged last
# one).
SHAPES = [
    (1, 8, 16),
    (2, 24, 20),
    (3, 40, 33),
    (4, 16, 32),
    (5, 40, 33),
    (6, 64, 16),
    (7, 300, 100),
    (64, 513, 48),
    (9, 1025, 40),
    (300, 300, 70),
    (400, 2101, 24),
]


@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_computes_what_f_linear_computes(
    rows: int, in_features: int, out_features: int, with_bias: bool, threads: int
) -> None:
    generator = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = gemm_linear(x, pack_weight(weight), bias)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, _reference(x, weight, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_new", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,in_features,out_features", [(7, 513, 40), (300, 300, 70)])
def test_the_activation_is_applied_as_outputs_are_written(
    activation: str, rows: int, in_features: int, out_features: int
) -> None:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    out = gemm_linear(x, pack_weight(weight), bias, activation)
    expected = ACTIVATIONS[activation](_reference(x, weight, bias).double()).float()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    # Far into both tails: GELU's erf and tanh saturate without overflow or NaN.
    assert out.isfinite().all()


# (rows, in, intermediate): halves that fill whole panels of 8 and ragged ones (1, 17, 33),
# reductions in one slice and in two and three (the sums kept whole until the last), few rows
# (panels outermost) and many (row blocks outermost).
GATED_SHAPES = [
    (1, 8, 8),
    (5, 40, 17),
    (7, 1025, 33),
    (64, 896, 64),
    (300, 2101, 1),
    (400, 300, 24),
]


@pytest.mark.parametrize("rows,in_features,intermediate", GATED_SHAPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_gated_projection_is_finished_as_its_outputs_are_written(
    rows: int, in_features: int, intermediate: int, activation: str, with_bias: bool, threads: int
) -> None:
    generator = torch.Generator().manual_seed(rows + intermediate)
    weight = torch.randn(2 * intermediate, in_features, generator=generator) * 0.2
    bias = torch.randn(2 * intermediate, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gated = pack_weight(weight, gated_by=activation)
        out = gemm_linear(x, gated, bias)
        unfused = gemm_linear(x, pack_weight(weight), bias)
    finally:
        torch.set_num_threads(previous)
    assert gated.shape == (intermediate, in_features) and out.shape == (rows, intermediate)
    gate, up = _reference(x, weight, bias).double().chunk(2, dim=-1)
    expected = (ACTIVATIONS[activation](gate) * up).float()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    if activation == "silu":  # the same sums, the same SiLU as the fused elementwise kernel's
        assert torch.equal(out, silu_and_mul(unfused))
    with pytest.raises(ValueError, match="no other activation"):
        gemm_linear(x, gated, bias, "relu")


def test_inputs_with_leading_dimensions_strides_or_no_rows() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=generator)
    packed = pack_weight(weight.t().contiguous().t())  # a column-major weight packs the same
    x = torch.randn(2, 9, 48, generator=generator)[..., ::2]  # every other column: strided
    out = gemm_linear(x, packed)
    assert out.shape == (2, 9, 40)
    torch.testing.assert_close(out, _reference(x, weight, None), atol=1e-4, rtol=1e-4)
    assert gemm_linear(torch.empty(0, 24), packed).shape == (0, 40)
    with pytest.raises(ValueError, match="does not fit"):
        gemm_linear(torch.randn(3, 23), packed)


def test_the_model_layers_run_on_the_kernel_and_keep_only_its_copy() -> None:
    generator = torch.Generator().manual_seed(2)
    column = ColumnParallelLinear(48, [32, 16, 16], bias=True)
    row = RowParallelLinear(64, 48, bias=True)
    tied, untied = VocabEmbedding(100, 32), LMHead(100, 32)
    for layer in (column, row, tied, untied):
        for parameter in layer.parameters():
            parameter.data.normal_(std=0.05, generator=generator)
    x = torch.randn(7, 48, generator=generator)
    hidden = torch.randn(5, 32, generator=generator)
    expected_column = F.linear(x, column.weight, column.bias)
    expected_row = F.linear(expected_column, row.weight, row.bias)
    expected_gelu = F.gelu(expected_column)
    expected_tied, expected_untied = tied.project(hidden), untied.project(hidden)

    gate_up, gate_up_onednn = (GateUpParallelLinear(48, 24, "silu", SINGLE_RANK) for _ in "ab")
    gate_up.weight.data.normal_(std=0.2, generator=generator)
    gate_up_onednn.weight.data.copy_(gate_up.weight)
    gate, up = F.linear(x, gate_up.weight).chunk(2, dim=-1)
    expected_gated = F.silu(gate) * up

    for layer in (column, row, tied, untied, gate_up):
        layer.prepack_for_cpu("c_gemm")
    gate_up_onednn.prepack_for_cpu("onednn")

    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(column(x), expected_column, **tolerance)
    torch.testing.assert_close(column(x, activation="gelu"), expected_gelu, **tolerance)
    torch.testing.assert_close(row(expected_column), expected_row, **tolerance)
    torch.testing.assert_close(tied.project(hidden), expected_tied, **tolerance)
    torch.testing.assert_close(untied.project(hidden), expected_untied, **tolerance)
    # The C kernel finishes a gated MLP's activation(gate) * up; oneDNN returns [gate | up].
    assert gate_up.gates_itself and not gate_up_onednn.gates_itself
    torch.testing.assert_close(gate_up(x), expected_gated, **tolerance)
    torch.testing.assert_close(gate_up_onednn(x), torch.cat([gate, up], dim=-1), **tolerance)
    # Only the kernel's panels are kept, except a tied table, which lookups still read.
    assert column.weight.is_meta and row.weight.is_meta and untied.weight.is_meta
    assert not tied.weight.is_meta


def test_the_faster_kernel_is_chosen_and_onednn_keeps_near_ties(tmp_path: Path) -> None:
    def chosen(onednn_s: float, c_gemm_s: float, cache: Path) -> str:
        clock = FakeClock()
        candidates = {"onednn": clock.costing(onednn_s), "c_gemm": clock.costing(c_gemm_s)}
        kernel, choice = choose_linear_kernel(
            CPU, TIMING, candidates=candidates, cache_dir=cache, clock=clock
        )
        assert choice is not None and choice.source is ChoiceSource.MEASURED
        assert choice.chosen == kernel
        return kernel

    assert chosen(0.010, 0.008, tmp_path / "a") == "c_gemm"
    assert chosen(0.008, 0.010, tmp_path / "b") == "onednn"
    assert chosen(0.0101, 0.0100, tmp_path / "c") == "onednn"  # within C_GEMM_MIN_SPEEDUP


def test_both_candidates_compute_the_same_layer() -> None:
    timing = LinearTiming(24, 40, torch.float32, (3,), activation="gelu")
    calls = linear_calls(timing, ["onednn", "c_gemm"])
    assert set(calls) == {"onednn", "c_gemm"}
    for call in calls.values():
        call()  # each runs the layer at every row count without error
    assert "gelu" in timing.key() and "[3 rows, 24] x [24, 40]" in timing.key()


def test_a_gated_projection_is_timed_with_the_pass_it_needs_on_each_kernel() -> None:
    # The C kernel finishes silu(gate) * up itself; oneDNN's [gate | up] goes through the
    # model's pass, which the timing runs after its product.
    timing = LinearTiming(24, 64, torch.float32, (3, 2), gated_by="silu")
    passed: list[torch.Size] = []

    def gate_pass(gate_up: torch.Tensor) -> torch.Tensor:
        passed.append(gate_up.shape)
        return silu_and_mul(gate_up)

    calls = linear_calls(timing, ["onednn", "c_gemm"], num_copies=2, gate_pass=gate_pass)
    calls["c_gemm"]()
    assert passed == []
    calls["onednn"]()
    assert passed == [torch.Size([3, 64]), torch.Size([2, 64])]
    assert "[3 + 2 rows, 24] x [24, 64] then silu(gate) * up" in timing.key()
    assert LinearTiming(24, 64, torch.float32, (3, 2)).key() != timing.key()


def test_the_gate_pass_is_the_models_own() -> None:
    def fused(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    linears = ModelLinears(torch.float32, gated_mlp=True, silu_and_mul=fused)
    assert linears.timing(64, 16, vocabulary=False, gated_by="silu").gated_by == "silu"
    assert linears.gate_pass("silu") is fused
    gate_up = torch.randn(5, 8)
    gate, up = gate_up.chunk(2, dim=-1)
    tanh_gelu = ACTIVATIONS["gelu_pytorch_tanh"]
    torch.testing.assert_close(
        linears.gate_pass("gelu_pytorch_tanh")(gate_up), tanh_gelu(gate) * up
    )


def test_only_onednn_runs_off_the_cpu(tmp_path: Path) -> None:
    assert choose_linear_kernel(torch.device("meta"), TIMING, cache_dir=tmp_path) == (
        "onednn",
        None,
    )


def test_each_shape_is_timed_as_the_model_runs_it() -> None:
    decoder = ModelLinears(torch.float32, gated_mlp=True)
    # A prefill slice, then as many rows again in decode-sized calls.
    assert decoder.timing(64, 16, vocabulary=False).row_counts == (128, 64, 64)
    assert decoder.timing(1000, 16, vocabulary=True).row_counts == (64,)
    encoder = ModelLinears(torch.float32, False, activation_shape=(64, 16), activation="gelu")
    assert encoder.timing(64, 16, vocabulary=False) == LinearTiming(
        16, 64, torch.float32, (linear_choice.ENCODER_ROWS,), "gelu"
    )
    assert encoder.timing(16, 64, vocabulary=False).activation is None  # the down projection


def test_a_vocabulary_wide_weight_is_timed_on_a_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_choice, "TIMED_WEIGHT_BYTES", 100 * 24 * 4)
    narrow = LinearTiming(24, 64, torch.float32, (3,))
    wide = LinearTiming(24, 1000, torch.float32, (3,))
    assert timed_out_features(narrow) == 64
    assert timed_out_features(wide) == 112  # 100 columns, rounded up to panels of 16
    calls = linear_calls(wide, ["onednn", "c_gemm"])
    for call in calls.values():
        call()
    assert "[24, 1000]" in wide.key()  # the choice is the whole shape's


def test_each_timed_product_reads_a_weight_no_cache_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timing = LinearTiming(32, 64, torch.float32, (4, 8))  # an 8 KiB weight
    # Copies to fill the cache twice over: 1 MiB of cache takes 256 copies, capped; a weight
    # twice the cache's size needs no second copy.
    assert linear_choice.timed_weight_copies(timing, cache_bytes=40 << 10) == 10
    assert linear_choice.timed_weight_copies(timing, cache_bytes=1 << 20) == (
        linear_choice.MAX_WEIGHT_COPIES
    )
    assert linear_choice.timed_weight_copies(timing, cache_bytes=4 << 10) == 1
    # Each product (two a call here) reads the next copy, each in memory of its own, every
    # copy as often as the others; they compute the same layer.
    used: list[int] = []
    outputs: list[torch.Tensor] = []
    real_linear = linear_choice.packed_linear

    def recording(x: torch.Tensor, packed: GemmWeight, *args: object) -> torch.Tensor:
        used.append(packed.panels.data_ptr())
        outputs.append(real_linear(x, packed, *args))  # type: ignore[arg-type]
        return outputs[-1]

    monkeypatch.setattr(linear_choice, "packed_linear", recording)
    call = linear_calls(timing, ["c_gemm"], num_copies=3)["c_gemm"]
    for _ in range(3):
        call()
    assert len(used) == 6 and len(set(used)) == 3
    assert used[:3] == used[3:]  # a rotation
    for first, later in zip(outputs[:2], outputs[2:4], strict=True):
        assert torch.equal(first, later)
    assert "weights from memory" in timing.key()


def test_the_largest_cpu_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    for index, size in [(0, "32K"), (2, "512K"), (3, "32768K")]:
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / "index1").mkdir()  # a level that does not say its size
    assert largest_cpu_cache_bytes(str(tmp_path)) == 32 << 20
    assert largest_cpu_cache_bytes(str(tmp_path / "absent")) is None


def test_the_chooser_times_each_shape_once(tmp_path: Path) -> None:
    chooser = LinearKernelChooser(CPU, ModelLinears(torch.float32, True), cache_dir=tmp_path)
    shapes = [(64, 16, False), (16, 64, False), (64, 16, False), (64, 16, True)]
    kernels = [chooser(*shape) for shape in shapes]
    assert kernels[0] == kernels[2] and set(kernels) <= {"onednn", "c_gemm"}
    # Three distinct shapes (the LM head's is timed at other rows), three measurements.
    assert [c.source for c in chooser.choices] == [ChoiceSource.MEASURED] * 3
    assert len({c.shape_key for c in chooser.choices}) == 3
    assert [c.chosen for c in chooser.choices] == [kernels[0], kernels[1], kernels[3]]


def test_a_forced_kernel_that_cannot_run_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(force_env_var(linear_choice.PHASE), "c_gemm")
    bf16 = LinearTiming(16, 64, torch.bfloat16, (4,))
    with pytest.raises(ValueError, match=r"'c_gemm'.*not one of the candidates"):
        choose_linear_kernel(CPU, bf16, cache_dir=tmp_path)


# Gated MLPs with SiLU (Qwen2), with tanh GELU (Gemma 2) and as a mixture's experts (Mixtral).
@pytest.mark.parametrize("family", ["qwen2", "gemma2", "mixtral"])
def test_a_model_on_the_c_kernel_generates_what_transformers_does(
    family: str, tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(force_env_var(linear_choice.PHASE), "c_gemm")
    model_dir = tiny_checkpoint(family)
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_num_batched_tokens=64)
    choices = [c for c in llm.loaded.measured_choices if c.phase == linear_choice.PHASE]
    assert choices and len(choices) == len({c.shape_key for c in choices})  # each shape once
    assert all(c.chosen == "c_gemm" and c.source is ChoiceSource.FORCED_ENV for c in choices)
    assert isinstance(llm.loaded.model.lm_head.packed_weight, GemmWeight)
    gate_ups = [m for m in llm.loaded.model.modules() if isinstance(m, GateUpParallelLinear)]
    assert gate_ups and all(m.gates_itself for m in gate_ups)
    generator = torch.Generator().manual_seed(3)
    vocab_size = llm.loaded.config.vocab_size
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (5, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, tokens in zip(prompts, ours, strict=True):
            generated = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, attention_mask=None
            )
            assert tokens == generated[0, len(prompt) :].tolist()


def test_a_float32_load_packs_each_shape_for_its_measured_kernel(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    config = EngineConfig(str(tiny_checkpoint("qwen2")), dtype="float32", device="cpu")
    loaded = load(config)
    measured = [c for c in loaded.measured_choices if c.phase == linear_choice.PHASE]
    # The attention's fused q/k/v and its output, the MLP's gate/up and down, the LM head.
    assert len(measured) == len({c.shape_key for c in measured}) == 5
    assert all(c.source is ChoiceSource.MEASURED for c in measured)
    assert all(set(c.best_time_s) == {"onednn", "c_gemm"} for c in measured)
    # The MLP's gate/up projection is timed through silu(gate) * up, as the layer runs it.
    gate_up_choices = [c for c in measured if "silu(gate) * up" in c.shape_key]
    assert len(gate_up_choices) == 1
    by_shape = {c.shape_key.split("] x [")[1].split("]")[0]: c.chosen for c in measured}
    layer = loaded.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        in_features, out_features = linear.weight.shape[1], linear.weight.shape[0]
        on_c_kernel = isinstance(linear.packed_weight, GemmWeight)
        assert on_c_kernel == (by_shape[f"{in_features}, {out_features}"] == "c_gemm")
    gates_on_c_kernel = gate_up_choices[0].chosen == "c_gemm"
    assert layer.mlp.gate_up_proj.gates_itself == gates_on_c_kernel
    again = [c for c in load(config).measured_choices if c.phase == linear_choice.PHASE]
    assert [c.source for c in again] == [ChoiceSource.CACHED] * 5
    assert [c.chosen for c in again] == [c.chosen for c in measured]
