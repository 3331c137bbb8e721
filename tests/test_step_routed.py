"""Engine steps routed by kind (StepRoutedBackend): decode-only steps on one backend, steps with
prefill chunks on another, sharing one KV cache, with the outputs of a single backend."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vacpack import LLM, SamplingParams
from vacpack.attention import BatchLayout, SelectedBackend, create_backend
from vacpack.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionSpec
from vacpack.attention.step_routed import StepRoutedBackend
from vacpack.engine import engine as engine_module
from vacpack.kvcache.paged_cache import KVLayer


class Recording(AttentionBackend):
    """A real backend that notes the query lengths of every step it builds metadata for."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.steps: list[list[int]] = []

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return self.inner.unsupported(spec)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> Any:
        self.steps.append(list(layout.query_lens))
        return self.inner.build_metadata(layout, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: Any,
        spec: AttentionSpec = FULL_ATTENTION,
    ) -> torch.Tensor:
        return self.inner.forward(q, k, v, kv_layer, metadata, spec)


def test_steps_are_routed_by_kind() -> None:
    decode = Recording(create_backend("torch_sdpa"))
    prefill = Recording(create_backend("torch_sdpa"))
    routed = StepRoutedBackend(decode=decode, prefill=prefill)
    assert routed.name == "torch_sdpa (decodes), torch_sdpa (prefills)"
    cpu = torch.device("cpu")
    decodes = BatchLayout([1, 1], [3, 5], [[0], [1, 2]], 4)
    mixed = BatchLayout([1, 3], [3, 5], [[0], [1, 2]], 4)
    fresh = BatchLayout([3, 2], [3, 2], [[0], [1]], 4)
    for layout in (decodes, mixed, fresh):
        routed.build_metadata(layout, cpu)
    assert decode.steps == [[1, 1]]
    assert prefill.steps == [[1, 3], [3, 2]]


def test_routed_engine_generates_what_one_backend_generates(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_checkpoint("qwen2")
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (5, 19, 40, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)

    def engine_llm() -> LLM:
        return LLM(
            str(model_dir), dtype="float32", device="cpu", block_size=4,
            max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
            kv_cache_memory_bytes=1 << 20,
        )  # fmt: skip

    expected = [o.outputs[0].token_ids for o in engine_llm().generate(prompts, params)]

    # The decodes take the matmul form, the prefills torch_sdpa's default: two real, different
    # implementations over the one cache.
    decode = Recording(create_backend("torch_sdpa", decode_form="matmuls", cascade=None))
    prefill = Recording(create_backend("torch_sdpa"))
    real_select = engine_module.select_engine_attention

    def select_routed(*args: Any) -> SelectedBackend:
        selected = real_select(*args)
        routed = StepRoutedBackend(decode=decode, prefill=prefill)
        return SelectedBackend(routed, selected.choices)

    monkeypatch.setattr(engine_module, "select_engine_attention", select_routed)
    llm = engine_llm()
    assert llm.engine.attention.name == "torch_sdpa (decodes), torch_sdpa (prefills)"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert decode.steps and all(n == 1 for step in decode.steps for n in step)
    assert prefill.steps and all(any(n > 1 for n in step) for step in prefill.steps)
