"""Each elementwise op of a model's layers from the implementation measured fastest for it.

Timings are injected: each candidate's first call runs for real where it can run here (the C
kernels only on a CPU with AVX512-BF16), and a fake clock advances by the cost each op's
candidate is given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock

from vacpack.config import EngineConfig
from vacpack.cpu_kernels import elementwise
from vacpack.models import layer_ops_choice
from vacpack.models.layer_ops import (
    DECODER_LAYER_OPS,
    ENCODER_LAYER_OPS,
    OP_NAMES,
    CpuKernelLayerOps,
    LayerOps,
    PerOpLayerOps,
)
from vacpack.models.layer_ops_choice import (
    LayerShapes,
    choose_layer_ops,
    op_calls,
)
from vacpack.runtime import load
from vacpack.testing.tiny_encoders import minilm_dir
from vacpack.tuning import ChoiceSource, force_env_var

CPU = torch.device("cpu")
KERNELS_RUN_HERE = elementwise.elementwise_kernels_available(CPU, torch.bfloat16)
KERNEL_AVAILABLE = elementwise.elementwise_kernels_available  # before the fixture fakes it
SHAPES = LayerShapes(
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    dtype=torch.bfloat16,
    num_rows=8,
)


@pytest.fixture(autouse=True)
def kernels_eligible(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(elementwise, "elementwise_kernels_available", lambda *args: True)
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))


def inject(
    monkeypatch: pytest.MonkeyPatch, fused_wins: set[str]
) -> tuple[FakeClock, list[tuple[str, str]]]:
    """The fused kernel takes 1 ms for the ops in `fused_wins`, 3 ms for the others; PyTorch's
    ops take 2 ms."""
    clock, calls = FakeClock(), []
    real = layer_ops_choice.op_calls

    def fake_op_calls(op: str, *args, **kwargs) -> dict[str, Callable[[], object]]:
        def fake(name: str, run: Callable[[], object]) -> Callable[[], None]:
            def call() -> None:
                calls.append((op, name))
                if calls.count((op, name)) == 1 and (name == "torch" or KERNELS_RUN_HERE):
                    run()
                fused = 0.001 if op in fused_wins else 0.003
                clock.now_s += fused if name == "cpu_kernels" else 0.002

            return call

        return {name: fake(name, run) for name, run in real(op, *args, **kwargs).items()}

    monkeypatch.setattr(layer_ops_choice, "op_calls", fake_op_calls)
    return clock, calls


def test_each_op_takes_its_faster_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, calls = inject(monkeypatch, fused_wins={"rms_norm", "rotary_qk"})
    ops, choices = choose_layer_ops(CPU, SHAPES, torch.bfloat16, clock=clock)
    assert isinstance(ops, PerOpLayerOps) and ops.mlp_rows_per_pass == 512
    assert {op: type(impl) for op, impl in ops.ops_by_name.items()} == {
        "rms_norm": CpuKernelLayerOps,
        "add_rms_norm": LayerOps,
        "silu_and_mul": LayerOps,
        "rotary_qk": CpuKernelLayerOps,
    }
    assert [c.phase for c in choices] == [f"layer_op_{op}" for op in DECODER_LAYER_OPS]
    assert all(c.source is ChoiceSource.MEASURED for c in choices)
    assert choices[0].best_time_s == pytest.approx({"cpu_kernels": 0.001, "torch": 0.002})
    assert {op for op, _ in calls} == set(DECODER_LAYER_OPS)  # a decoder's ops alone


def test_one_implementation_winning_every_op_is_used_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock, _ = inject(monkeypatch, fused_wins=set(OP_NAMES))
    ops, _ = choose_layer_ops(CPU, SHAPES, torch.bfloat16, clock=clock)
    assert type(ops) is CpuKernelLayerOps
    clock, _ = inject(monkeypatch, fused_wins=set())
    ops, choices = choose_layer_ops(CPU, SHAPES, torch.bfloat16, clock=clock)
    assert choices[0].source is ChoiceSource.CACHED  # the cache holds the first answer
    other = LayerShapes(**{**SHAPES.__dict__, "num_rows": 16})  # in every op's key
    ops, choices = choose_layer_ops(CPU, other, torch.bfloat16, clock=clock)
    assert choices[0].source is ChoiceSource.MEASURED and type(ops) is LayerOps


def test_an_op_is_forced_by_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, calls = inject(monkeypatch, fused_wins=set(OP_NAMES))
    monkeypatch.setenv(force_env_var("layer_op_silu_and_mul"), "torch")
    ops, choices = choose_layer_ops(CPU, SHAPES, torch.bfloat16, clock=clock)
    assert isinstance(ops, PerOpLayerOps)
    assert type(ops.ops_by_name["silu_and_mul"]) is LayerOps
    assert choices[2].source is ChoiceSource.FORCED_ENV
    assert "silu_and_mul" not in {op for op, _ in calls}


def test_a_sole_implementation_is_taken_without_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, calls = inject(monkeypatch, fused_wins=set(OP_NAMES))
    ops, choices = choose_layer_ops(CPU, SHAPES, torch.float16, clock=clock)  # no fused fp16
    assert type(ops) is LayerOps and choices == () and calls == []


def test_per_op_ops_run_each_op_where_chosen() -> None:
    calls: list[str] = []

    class Recording(LayerOps):
        name = "recording"

        def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            calls.append("rms_norm")
            return super().rms_norm(x, weight, eps)

        def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
            calls.append("silu_and_mul")
            return super().silu_and_mul(gate_up)

    reference, recording = LayerOps(), Recording()
    ops = PerOpLayerOps(
        512,
        {"rms_norm": recording, "add_rms_norm": reference, "silu_and_mul": reference}
        | {"rotary_qk": recording},
    )  # add_layer_norm not given: PyTorch's
    expected_name = (
        "rms_norm recording, add_rms_norm torch, silu_and_mul torch, rotary_qk recording"
    )
    assert ops.name == expected_name
    float32 = LayerShapes(**{**SHAPES.__dict__, "dtype": torch.float32})
    for op in OP_NAMES:
        got = op_calls(op, {"per_op": ops, "reference": reference}, float32, CPU)
        outputs = {name: call() for name, call in got.items()}
        torch.testing.assert_close(outputs["per_op"], outputs["reference"])
    assert calls == ["rms_norm"]
    with pytest.raises(ValueError, match="no such layer ops"):
        PerOpLayerOps(512, {"layer_norm": reference})


def test_shapes_come_from_a_decoder_config() -> None:
    class Config:
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads = 64, 96, 4, 2

    shapes = LayerShapes.from_hf(Config(), torch.bfloat16)
    assert shapes is not None and (shapes.head_dim, shapes.num_kv_heads) == (16, 2)
    assert LayerShapes.from_hf(object(), torch.bfloat16) is None


def test_an_op_only_pytorch_runs_in_a_dtype_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused add with LayerNorm exists in float32 alone: in bf16 the C kernels' ops would
    run PyTorch's for it, so nothing is timed for it; an encoder's float32 load times it."""
    assert not KERNEL_AVAILABLE(CPU, torch.bfloat16, "add_layer_norm")

    def available(device: torch.device, dtype: torch.dtype, op: str = "rms_norm") -> bool:
        return op != "add_layer_norm" or dtype == torch.float32  # every other kernel runs

    monkeypatch.setattr(elementwise, "elementwise_kernels_available", available)
    clock, calls = inject(monkeypatch, fused_wins=set(OP_NAMES))
    assert not CpuKernelLayerOps().implements("add_layer_norm", torch.bfloat16)
    ops, choices = choose_layer_ops(CPU, SHAPES, torch.bfloat16, ENCODER_LAYER_OPS, clock=clock)
    assert choices == () and calls == [] and type(ops) is LayerOps  # its only candidate
    if KERNEL_AVAILABLE(CPU, torch.float32, "add_layer_norm"):
        float32 = LayerShapes(**{**SHAPES.__dict__, "dtype": torch.float32})
        ops, choices = choose_layer_ops(CPU, float32, torch.float32, ENCODER_LAYER_OPS, clock=clock)
        assert [c.phase for c in choices] == ["layer_op_add_layer_norm"]
        assert type(ops) is CpuKernelLayerOps and {op for op, _ in calls} == {"add_layer_norm"}


def test_each_family_times_the_ops_its_layers_call(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder's load times its RMSNorm, SiLU and rotary ops where fused float32 kernels run,
    an encoder's its residual add with LayerNorm, and each model runs what was chosen."""
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    fused = elementwise.elementwise_kernels_available(CPU, torch.float32)
    decoder = load(EngineConfig(str(tiny_checkpoint("qwen2")), dtype="float32", device="cpu"))
    phases = {c.phase for c in decoder.measured_choices}
    decoder_phases = {f"layer_op_{op}" for op in DECODER_LAYER_OPS}
    assert (decoder_phases <= phases) == fused and "layer_op_add_layer_norm" not in phases
    encoder = load(EngineConfig(str(minilm_dir()), dtype="float32", device="cpu"))
    choices = [c for c in encoder.measured_choices if c.phase.startswith("layer_op_")]
    assert [c.phase for c in choices] == (["layer_op_add_layer_norm"] if fused else [])
    if choices:  # the layers hold the chosen implementation
        assert encoder.model.layers[0].mlp_norm.ops.name == choices[0].chosen
