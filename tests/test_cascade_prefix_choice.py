"""How torch_sdpa's cascade attends shared prefixes (matmuls, or the C varlen kernel) is chosen
by measurement where the kernel runs, and the engine's greedy outputs are the same either way.
Timings are injected through a fake clock; the end-to-end check runs the real kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_clock import FakeClock
from shared_prompts import shared_prefix_prompts

from vacpack import LLM, SamplingParams, cpu_kernels
from vacpack.attention import AttentionShapes, DecodeBatchShape, select_backend, timed_steps
from vacpack.attention import cascade as cascade_module
from vacpack.attention.backend import AttentionSpec
from vacpack.attention.cascade import PREFIX_FORMS, CascadePolicy
from vacpack.attention.cascade_selection import CASCADE_PREFIX_PHASE, cascade_shapes
from vacpack.attention.timed_steps import TimedCall
from vacpack.attention.torch_sdpa import TorchSdpaBackend
from vacpack.tuning import ChoiceSource, force_env_var

CPU = torch.device("cpu")
SHAPES = AttentionShapes(4, 2, 32, torch.float32, max_model_len=2048)
DECODES = DecodeBatchShape(num_seqs=64, longest_context=40, page_size=16)


@pytest.fixture(autouse=True)
def _options_forced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The prefill and decode kernels forced, so that only the prefix form and the cascade
    policy are timed; choices cached in a fresh folder."""
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    monkeypatch.setenv(force_env_var("sdpa_prefill"), "sdpa")
    monkeypatch.setenv(force_env_var("sdpa_decode"), "matmuls")


def _inject(monkeypatch: pytest.MonkeyPatch, prefix_costs_s: dict[str, float]) -> FakeClock:
    """Prefix forms cost what they are given; a cascade and none cost the same."""
    clock = FakeClock()

    def timed_calls(backends, shapes, workload, device, specs=None) -> dict[str, TimedCall]:
        costs = prefix_costs_s if set(backends) == set(PREFIX_FORMS) else {}
        return {name: clock.costing(costs.get(name, 0.001)) for name in backends}

    monkeypatch.setattr(timed_steps, "timed_calls", timed_calls)
    return clock


@pytest.mark.parametrize("fastest", PREFIX_FORMS)
def test_cascade_prefixes_run_in_the_form_measured_faster(
    monkeypatch: pytest.MonkeyPatch, fastest: str
) -> None:
    monkeypatch.setattr(cpu_kernels, "varlen_attention_supported", lambda *args: True)
    clock = _inject(monkeypatch, {"matmuls": 0.002, "kernel": 0.002, fastest: 0.001})
    selected = select_backend("torch_sdpa", CPU, SHAPES, DECODES, clock=clock)
    assert isinstance(selected.backend, TorchSdpaBackend)
    assert selected.backend.prefix_form == fastest
    phases = [c.phase for c in selected.choices]
    # After the decode form (the cascade's own pages run in it), before the cascade policy,
    # which is timed with the chosen prefix form.
    assert phases.index("sdpa_decode") < phases.index(CASCADE_PREFIX_PHASE)
    assert phases.index(CASCADE_PREFIX_PHASE) < phases.index("attention_cascade")
    choice = selected.choices[phases.index(CASCADE_PREFIX_PHASE)]
    assert choice.chosen == fastest and choice.source is ChoiceSource.MEASURED
    longest = cascade_shapes(DECODES, SHAPES.max_model_len)[-1]
    assert f"{longest.shared_prefix_tokens} shared" in choice.shape_key


def test_no_prefix_choice_where_the_kernel_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _inject(monkeypatch, {"matmuls": 0.002, "kernel": 0.001})
    soft_capped = AttentionShapes(
        4, 2, 32, torch.float32, (AttentionSpec(logit_softcap=30.0),), max_model_len=2048
    )
    monkeypatch.setattr(cpu_kernels, "varlen_attention_supported", lambda *args: True)
    capped = select_backend("torch_sdpa", CPU, soft_capped, DECODES, clock=clock)
    monkeypatch.setattr(cpu_kernels, "varlen_attention_supported", lambda *args: False)
    no_kernel = select_backend("torch_sdpa", CPU, SHAPES, DECODES, clock=clock)
    for selected in (capped, no_kernel):
        assert isinstance(selected.backend, TorchSdpaBackend)
        assert CASCADE_PREFIX_PHASE not in [c.phase for c in selected.choices]
        assert selected.backend.prefix_form == "matmuls"


@pytest.mark.skipif(
    not cpu_kernels.varlen_attention_supported(CPU, torch.float32, 16),
    reason="needs a C compiler",
)
def test_greedy_outputs_are_the_same_with_either_prefix_form(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sixteen requests behind one cached 100-token prompt, every step's shared prefix in a
    cascade: the kernel's prefixes give the tokens the matmuls' do."""
    kernel_calls = []
    real_attend = cascade_module.attend_with_lse

    def counting(*args, **kwargs):
        kernel_calls.append(1)
        return real_attend(*args, **kwargs)

    monkeypatch.setattr(cascade_module, "attend_with_lse", counting)
    model_dir = str(tiny_checkpoint("qwen3"))
    always = CascadePolicy(min_prefix_tokens=1, min_saved_tokens=1)
    tokens: dict[str, list[list[int]]] = {}
    for form in PREFIX_FORMS:
        llm = LLM(model_dir, dtype="float32", attention_backend="torch_sdpa", block_size=8)
        backend = llm.engine.attention
        assert isinstance(backend, TorchSdpaBackend)
        backend.cascade, backend.prefix_form = always, form
        kernel_calls.clear()  # the load's own timings ran both forms
        prompts = shared_prefix_prompts(llm.loaded.config.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.generate(prompts[:1], params, use_tqdm=False)  # the shared prompt's pages cached
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[form] = [o.outputs[0].token_ids for o in outputs]
        assert bool(kernel_calls) == (form == "kernel"), "the prefixes ran in the form set"
    assert tokens["kernel"] == tokens["matmuls"]
