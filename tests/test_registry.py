"""Registries with lazy imports, and what each attention backend and layer-ops set supports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vacpack.attention import Phase, auto_candidates, eligible_backends, resolve_backend_name
from vacpack.cpu_kernels.elementwise import elementwise_kernels_available
from vacpack.models.layer_ops import CpuKernelLayerOps, LayerOps, select_layer_ops
from vacpack.models.registry import model_class_for
from vacpack.registry import LazyRegistry

CPU = torch.device("cpu")


def test_an_entry_is_imported_when_first_asked_for() -> None:
    registry: LazyRegistry[object] = LazyRegistry("thing", {"dumps": "json:dumps"})
    assert "dumps" in registry and "loads" not in registry
    import json

    assert registry.get("dumps") is json.dumps
    with pytest.raises(ValueError, match="thing 'loads' is not supported; supported: dumps"):
        registry.get("loads")
    with pytest.raises(ValueError, match="module:attribute"):
        registry.register("bad", "no_colon")


def test_importing_vacpack_loads_no_backend_or_model_family() -> None:
    code = (
        "import sys, vacpack\n"
        "lazy = ['vacpack.attention.triton_backend', 'vacpack.attention.cpu_kernel_backend',\n"
        "        'vacpack.models.bert', 'vacpack.models.llama_classifier', 'triton']\n"
        "print([name for name in lazy if name in sys.modules])\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_an_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(
        ValueError, match=r"architecture 'GPT2LMHeadModel' is not supported; supported: .*BertModel"
    ):
        model_class_for("GPT2LMHeadModel")


def test_each_backend_declares_what_it_runs() -> None:
    # The portable backend runs everything; the C kernels want bf16 with head sizes of 32k,
    # or float32 with head sizes of 8k, and no float16.
    assert eligible_backends(CPU, torch.float32, 64, Phase.PAGED)[-1] == "torch_sdpa"
    assert "cpu_kernels" not in eligible_backends(CPU, torch.float32, 44, Phase.PAGED)
    assert "cpu_kernels" not in eligible_backends(CPU, torch.float16, 64, Phase.PAGED)
    assert "cpu_kernels" not in eligible_backends(CPU, torch.bfloat16, 48, Phase.PACKED)
    assert eligible_backends(CPU, torch.bfloat16, 64, Phase.PACKED)[-1] == "torch_sdpa"
    # Triton runs on a CPU only in its interpreter (the kernels' tests): never picked there.
    assert auto_candidates(CPU, torch.float16, 64) == ["torch_sdpa"]


def test_a_forced_backend_that_cannot_run_here_says_why() -> None:
    with pytest.raises(ValueError, match="'cpu_kernels' cannot run packed attention for a float16"):
        resolve_backend_name("cpu_kernels", CPU, torch.float16, 64, Phase.PACKED)
    with pytest.raises(ValueError, match="attention backend 'flash' is not supported"):
        resolve_backend_name("flash", CPU, torch.float32, 64)
    assert resolve_backend_name("torch_sdpa", CPU, torch.bfloat16, 64) == "torch_sdpa"


def test_layer_ops_are_chosen_for_the_device_and_dtype() -> None:
    ops = select_layer_ops(CPU, torch.float32)
    # The fused float32 C kernels, wherever a C compiler builds them.
    fused = elementwise_kernels_available(CPU, torch.float32)
    assert type(ops) is (CpuKernelLayerOps if fused else LayerOps)
    assert ops.mlp_rows_per_pass == 512  # a CPU's caches hold a slice of rows, not a whole step
    assert type(select_layer_ops(CPU, torch.float16)) is LayerOps  # no fused float16 kernels
