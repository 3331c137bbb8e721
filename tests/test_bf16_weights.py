"""bfloat16 weights with float32 arithmetic, for CPUs without bfloat16 instructions: the C kernel
on bfloat16 panels computes what it computes on their float32 values; a bfloat16 model loaded so
keeps its matrices in bfloat16 and gives what transformers gives on the same rounded matrices in
float32; the arithmetic is chosen by measurement (timings injected through a fake clock) or by
name, and reported."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock
from transformers import AutoModelForCausalLM, BertModel

from vacpack import LLM, SamplingParams
from vacpack.config import EngineConfig
from vacpack.cpu_kernels.gemm import gemm_linear, gemm_supported, pack_weight
from vacpack.models import cpu_dtype
from vacpack.models.cpu_dtype import (
    LinearShape,
    bf16_arithmetic_candidates,
    choose_bf16_arithmetic,
    choose_weight_dtype,
    weight_dtype_candidates,
)
from vacpack.models.linear_choice import eligible_linear_kernels
from vacpack.models.parallel import ColumnParallelLinear, RowParallelLinear, VocabEmbedding
from vacpack.runtime import load
from vacpack.testing.packed_forward import packed_forward
from vacpack.testing.tiny_encoders import build_tiny_bert
from vacpack.tuning import ChoiceSource, MeasuredChoice, force_env_var

pytestmark = pytest.mark.skipif(
    not gemm_supported(torch.bfloat16), reason="the C kernels do not build here (no C compiler)"
)
CPU = torch.device("cpu")
FLOAT32_ARITHMETIC = dict(dtype="bfloat16", device="cpu", cpu_bf16_arithmetic="float32")


@pytest.fixture(autouse=True)
def _not_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite pins bfloat16 arithmetic and float32 weights for the other tests
    (conftest.py); not here."""
    monkeypatch.delenv(force_env_var(cpu_dtype.ARITHMETIC_PHASE), raising=False)
    monkeypatch.delenv(force_env_var(cpu_dtype.WEIGHTS_PHASE), raising=False)


# (rows, in, out, activation): a decode's few rows (inputs packed whole), a prefill's many
# (blocked), a reduction of two slices, output features short of a panel, bias and activation.
SHAPES = [(1, 64, 48, None), (7, 1100, 40, "gelu"), (400, 1100, 37, "silu"), (200, 96, 64, None)]


@pytest.mark.parametrize(("rows", "inner", "out", "activation"), SHAPES)
def test_bfloat16_panels_compute_what_their_float32_values_do(
    rows: int, inner: int, out: int, activation: str | None
) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out, inner, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out, generator=generator)
    x = torch.randn(rows, inner, generator=generator)
    packed = pack_weight(weight)
    assert packed.dtype == torch.bfloat16 and packed.panels.element_size() == 2
    widened = gemm_linear(x, pack_weight(weight.float()), bias, activation)
    # The same float32 arithmetic on the same values: the same bits.
    assert torch.equal(gemm_linear(x, packed, bias, activation), widened)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    if activation == "silu":
        expected = torch.nn.functional.silu(expected)
    elif activation == "gelu":
        expected = torch.nn.functional.gelu(expected)
    torch.testing.assert_close(widened, expected.float(), atol=2e-4, rtol=1e-4)


def test_a_gated_projection_on_bfloat16_panels() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(2 * 40, 1100, generator=generator).to(torch.bfloat16)
    x = torch.randn(9, 1100, generator=generator)
    out = gemm_linear(x, pack_weight(gate_up, gated_by="silu"))
    assert torch.equal(out, gemm_linear(x, pack_weight(gate_up.float(), gated_by="silu")))
    gate, up = torch.nn.functional.linear(x.double(), gate_up.double()).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).float()  # |values| up to ~1,000
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-4)


def test_only_the_c_kernel_multiplies_bfloat16_weights_in_float32() -> None:
    assert eligible_linear_kernels(CPU, torch.float32, torch.bfloat16) == ["c_gemm"]
    # bfloat16 arithmetic is oneDNN's and, on AVX512-BF16 CPUs, the bf16 C kernel's; float32
    # on float32 weights has oneDNN and the float32 C kernel.
    bf16_runs = gemm_supported(torch.bfloat16, torch.bfloat16)
    bf16_kernels = ["onednn", "c_gemm_bf16"] if bf16_runs else ["onednn"]
    assert eligible_linear_kernels(CPU, torch.bfloat16) == bf16_kernels
    assert eligible_linear_kernels(CPU, torch.float32) == ["onednn", "c_gemm"]


SHAPE = LinearShape(num_rows=4, in_features=16, out_features=32)


def _chosen(
    tmp_path: Path,
    bf16_s: float,
    fp32_s: float,
    choose: Callable[..., MeasuredChoice] = choose_bf16_arithmetic,
    **kw: object,
) -> MeasuredChoice:
    clock = FakeClock()
    candidates = {"bfloat16": clock.costing(bf16_s), "float32": clock.costing(fp32_s)}
    return choose(SHAPE, candidates=candidates, cache_dir=tmp_path, clock=clock, **kw)


def test_float32_arithmetic_where_bfloat16_is_much_slower(tmp_path: Path) -> None:
    choice = _chosen(tmp_path, bf16_s=0.007, fp32_s=0.001)
    assert choice.chosen == "float32" and choice.source is ChoiceSource.MEASURED
    assert choice.phase == cpu_dtype.ARITHMETIC_PHASE


@pytest.mark.parametrize("bf16_s", [0.0012, 0.0005], ids=["slightly-slower", "faster"])
def test_bfloat16_arithmetic_where_it_is_about_as_fast(tmp_path: Path, bf16_s: float) -> None:
    assert _chosen(tmp_path, bf16_s=bf16_s, fp32_s=0.001).chosen == "bfloat16"


def test_a_named_arithmetic_is_honoured(tmp_path: Path) -> None:
    forced = _chosen(tmp_path, bf16_s=0.0005, fp32_s=0.001, forced="float32")
    assert forced.chosen == "float32" and forced.source is ChoiceSource.FORCED_ARGUMENT
    with pytest.raises(ValueError, match="not one of the candidates"):
        _chosen(tmp_path, bf16_s=0.0005, fp32_s=0.001, forced="float16")
    with pytest.raises(ValueError, match="cpu_bf16_arithmetic must be"):
        EngineConfig("model", cpu_bf16_arithmetic="int8")


@pytest.mark.parametrize(("bf16_s", "chosen"), [(0.00105, "bfloat16"), (0.0012, "float32")])
def test_a_bfloat16_checkpoint_run_in_float32_keeps_bfloat16_weights_unless_slower(
    tmp_path: Path, bf16_s: float, chosen: str
) -> None:
    choice = _chosen(tmp_path, bf16_s=bf16_s, fp32_s=0.001, choose=choose_weight_dtype)
    assert choice.phase == cpu_dtype.WEIGHTS_PHASE and choice.chosen == chosen


def test_without_the_c_kernel_only_bfloat16_arithmetic_and_float32_weights_remain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_dtype, "float32_arithmetic_runs", lambda: False)
    arithmetic = choose_bf16_arithmetic(SHAPE, cache_dir=tmp_path)
    weights = choose_weight_dtype(SHAPE, cache_dir=tmp_path)
    assert arithmetic.chosen == "bfloat16" and weights.chosen == "float32"
    assert arithmetic.source is weights.source is ChoiceSource.ONLY_CANDIDATE


@pytest.mark.parametrize("make", [bf16_arithmetic_candidates, weight_dtype_candidates])
def test_both_candidates_run_the_same_linear(
    make: Callable[[LinearShape], dict[str, Callable[[], object]]],
) -> None:
    outputs = {name: run() for name, run in make(SHAPE).items()}
    assert outputs["float32"].dtype == torch.float32
    torch.testing.assert_close(
        outputs["bfloat16"].float(), outputs["float32"], atol=2e-2, rtol=2e-2
    )


def _round_matrices(model: torch.nn.Module, matrices: tuple[type, ...]) -> None:
    """transformers' model with the weights vacpack keeps in bfloat16 rounded to it."""
    for module in model.modules():
        if isinstance(module, matrices):
            module.weight.data = module.weight.data.bfloat16().float()


# A mixture's routers are plain linears, kept in the model's dtype (vacpack's too).
ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight")


def _round_decoder_matrices(model: torch.nn.Module) -> None:
    """A decoder's matrices, as vacpack keeps them: every linear's and table's but the
    routers' (experts may be one 3-D parameter each)."""
    for name, parameter in model.named_parameters():
        if parameter.dim() >= 2 and not name.endswith(ROUTERS):
            parameter.data = parameter.data.bfloat16().float()


# Qwen2's biases; Gemma 3's scaled, tied embeddings and sliding windows; a mixture's experts.
@pytest.mark.parametrize("family", ["qwen2", "gemma3", "qwen2_moe"])
def test_a_decoder_keeps_its_matrices_in_bfloat16_and_matches_transformers(
    tiny_checkpoint, family: str
) -> None:
    model_dir = tiny_checkpoint(family)
    # A float32 KV cache, so that transformers in float32 is the exact reference (the bfloat16
    # cache is tested in test_bf16_kv_cache.py).
    llm = LLM(
        str(model_dir),
        block_size=4,
        max_num_batched_tokens=64,
        kv_cache_dtype="float32",
        **FLOAT32_ARITHMETIC,
    )
    loaded = llm.loaded
    assert loaded.dtype == torch.float32 and loaded.weight_dtype == torch.bfloat16
    assert loaded.dtype_description == "bfloat16 weights, float32 arithmetic"
    assert llm.engine.kv_cache.keys.dtype == torch.float32
    for module in loaded.model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabEmbedding):
            assert module.packed_weight is None or module.packed_weight.dtype == torch.bfloat16
            assert module.weight.dtype == torch.bfloat16
    norms = [p for name, p in loaded.model.named_parameters() if "norm" in name]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    (choice,) = [c for c in loaded.measured_choices if c.phase == cpu_dtype.ARITHMETIC_PHASE]
    assert choice.chosen == "float32" and choice.source is ChoiceSource.FORCED_ARGUMENT

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _round_decoder_matrices(reference)
    generator = torch.Generator().manual_seed(0)
    vocab_size = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (3, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=8,
                do_sample=False,
            )[0, len(prompt) :].tolist()
            logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], -1)
        assert output.outputs[0].token_ids == expected
        for position in range(1, len(prompt)):
            token = prompt[position]
            ours = output.prompt_logprobs[position][token].logprob
            assert ours == pytest.approx(float(logprobs[position - 1, token]), abs=1e-4)


def test_an_encoder_keeps_its_matrices_in_bfloat16_and_matches_transformers(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_bert(tmp_path / "bert")
    loaded = load(EngineConfig(str(model_dir), **FLOAT32_ARITHMETIC))
    assert loaded.dtype == torch.float32 and loaded.weight_dtype == torch.bfloat16
    table = loaded.model.embeddings.word_embeddings
    assert table.weight.dtype == torch.bfloat16 and table.dtype == torch.float32
    texts = ["a short one.", "Packed encoders keep no padding at all, " * 6, "bfloat16 weights"]
    sequences = [loaded.tokenizer(text)["input_ids"] for text in texts]
    hidden = packed_forward(loaded.model, sequences)
    assert hidden.dtype == torch.float32

    reference = BertModel.from_pretrained(model_dir).eval()
    _round_matrices(reference, (torch.nn.Linear,))
    _round_matrices(reference.embeddings.word_embeddings, (torch.nn.Embedding,))
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([s])).last_hidden_state[0] for s in sequences])
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_loads_follow_the_measured_arithmetic(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    model_dir = str(tiny_checkpoint("qwen2"))
    loaded = load(EngineConfig(model_dir, dtype="bfloat16", device="cpu"))
    (choice,) = [c for c in loaded.measured_choices if c.phase == cpu_dtype.ARITHMETIC_PHASE]
    assert choice.source is ChoiceSource.MEASURED
    assert set(choice.best_time_s) == {"bfloat16", "float32"}
    assert loaded.dtype == cpu_dtype.DTYPES[choice.chosen]
    assert (loaded.weight_dtype or loaded.dtype) == torch.bfloat16
    # The next load takes it from the cache; the environment variable overrides it.
    again = load(EngineConfig(model_dir, dtype="bfloat16", device="cpu"))
    assert again.measured_choices[0].source is ChoiceSource.CACHED
    monkeypatch.setenv(force_env_var(cpu_dtype.ARITHMETIC_PHASE), "bfloat16")
    native = load(EngineConfig(model_dir, dtype="bfloat16", device="cpu"))
    assert native.dtype == torch.bfloat16 and native.weight_dtype is None
    assert native.dtype_description == "bfloat16"


def test_dtype_auto_keeps_a_bfloat16_checkpoints_weights_in_bfloat16_where_as_fast(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    # auto takes float32 here (as on a CPU without bfloat16 instructions), then times the
    # weights' dtype.
    monkeypatch.setenv(force_env_var(cpu_dtype.PHASE), "float32")
    bf16_dir = str(tiny_checkpoint("qwen2", dtype=torch.bfloat16))
    loaded = load(EngineConfig(bf16_dir, device="cpu"))
    (choice,) = [c for c in loaded.measured_choices if c.phase == cpu_dtype.WEIGHTS_PHASE]
    assert choice.source is ChoiceSource.MEASURED
    assert set(choice.best_time_s) == {"bfloat16", "float32"}
    assert loaded.dtype == torch.float32
    assert (loaded.weight_dtype or loaded.dtype) == cpu_dtype.DTYPES[choice.chosen]
    # Forced to bfloat16: the matrices are bfloat16, as in the file.
    monkeypatch.setenv(force_env_var(cpu_dtype.WEIGHTS_PHASE), "bfloat16")
    kept = load(EngineConfig(bf16_dir, device="cpu"))
    assert kept.dtype_description == "bfloat16 weights and KV cache, float32 arithmetic"
    # A float32 checkpoint is never rounded.
    float32_dir = str(tiny_checkpoint("qwen2"))
    plain = load(EngineConfig(float32_dir, device="cpu"))
    assert plain.weight_dtype is None
    assert cpu_dtype.WEIGHTS_PHASE not in {c.phase for c in plain.measured_choices}
