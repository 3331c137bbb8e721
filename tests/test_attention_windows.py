"""Sliding windows, score scales and soft-capping in the attention backends, against a direct
reference: for each query, a float64 softmax over exactly the keys it may see."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton_marks import TRITON_RUNS

from vacpack import cpu_kernels
from vacpack.attention import (
    AttentionShapes,
    BatchLayout,
    PackedBinShape,
    auto_candidates,
    create_backend,
    select_backend,
)
from vacpack.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionSpec
from vacpack.attention.cascade import CascadePolicy
from vacpack.attention.paged_decode import DECODE_FORMS, KERNEL_FORMS, kernel_form_supported
from vacpack.attention.torch_sdpa import TorchSdpaBackend, build_slot_mapping
from vacpack.engine.window_pages import RELEASED_PAGE
from vacpack.kvcache.paged_cache import PagedKVCache

CPU = torch.device("cpu")
PAGE_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
# Decodes (contexts inside, at and past the window), prefill chunks over cached pages, a fresh
# prompt longer than the window and a short one.
QUERY_LENS = (1, 1, 1, 1, 1, 13, 9, 11, 3)
CONTEXT_LENS = (1, 3, 7, 16, 37, 29, 24, 11, 3)
# The decode forms that run float32 (the bf16 kernels': tests/test_bf16_decode_kernels.py).
FLOAT32_DECODE_FORMS = [
    form
    for form in DECODE_FORMS
    if form not in KERNEL_FORMS or KERNEL_FORMS[form].bf16_kernel is None
]
SPECS = [
    pytest.param(AttentionSpec(sliding_window=5), id="window"),
    pytest.param(AttentionSpec(sliding_window=8, scale=0.3, logit_softcap=2.0), id="all"),
    pytest.param(AttentionSpec(logit_softcap=1.5), id="softcap"),
    pytest.param(AttentionSpec(scale=0.11), id="scale"),
    pytest.param(FULL_ATTENTION, id="plain"),
]


@dataclass(frozen=True)
class Step:
    layout: BatchLayout
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: PagedKVCache  # the earlier tokens' keys and values


def _step(
    spec: AttentionSpec,
    release_dead_pages: bool = False,
    seed: int = 0,
    query_lens: tuple[int, ...] = QUERY_LENS,
    context_lens: tuple[int, ...] = CONTEXT_LENS,
    num_shared_pages: int = 0,
) -> Step:
    """Sequences on shuffled pages; the first num_shared_pages of every table are the same
    pages (a cached prefix)."""
    generator = torch.Generator().manual_seed(seed)
    own_pages = [-(-n // PAGE_SIZE) - num_shared_pages for n in context_lens]
    num_pages = num_shared_pages + sum(own_pages) + 2
    order = torch.randperm(num_pages, generator=generator).tolist()
    shared, start = order[:num_shared_pages], num_shared_pages
    page_tables = []
    for count, query_len, context_len in zip(own_pages, query_lens, context_lens, strict=True):
        table = shared + order[start : start + count]
        start += count
        window = spec.sliding_window
        if release_dead_pages and window is not None:
            # As the scheduler leaves them: pages wholly before the first query's window.
            num_dead = max(0, context_len - query_len - window + 1) // PAGE_SIZE
            table[:num_dead] = [RELEASED_PAGE] * num_dead
        page_tables.append(table)
    cache = PagedKVCache(1, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, CPU)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    num_tokens = sum(query_lens)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, HEAD_DIM, generator=generator)

    layout = BatchLayout(
        query_lens, context_lens, page_tables, PAGE_SIZE, attention_windows=(spec.sliding_window,)
    )
    return Step(layout, rand(NUM_HEADS), rand(NUM_KV_HEADS), rand(NUM_KV_HEADS), cache)


def _reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spec: AttentionSpec
) -> torch.Tensor:
    """q [queries, heads, dim] are the last queries of a sequence whose keys and values are
    [num_keys, kv_heads, dim]; float64 and explicit."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * spec.scale_for(HEAD_DIM)
    if spec.logit_softcap is not None:
        scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    query_positions = torch.arange(num_keys - num_queries, num_keys).unsqueeze(1)
    offsets = query_positions - torch.arange(num_keys)
    visible = offsets >= 0
    if spec.sliding_window is not None:
        visible &= offsets < spec.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values).float()


def _reference(step: Step, spec: AttentionSpec) -> torch.Tensor:
    cache = PagedKVCache(
        1, step.cache.num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, CPU
    )
    cache.keys.copy_(step.cache.keys)
    cache.values.copy_(step.cache.values)
    cache.layer(0).write(build_slot_mapping(step.layout), step.k, step.v)
    out, row = torch.empty_like(step.q), 0
    layout = step.layout
    for query_len, context_len, pages in zip(
        layout.query_lens, layout.context_lens, layout.page_tables, strict=True
    ):
        positions = torch.arange(context_len)
        page_ids = torch.tensor(pages)[positions // PAGE_SIZE].clamp(min=0)
        slots = page_ids * PAGE_SIZE + positions % PAGE_SIZE
        rows = slice(row, row + query_len)
        out[rows] = _reference_attention(
            step.q[rows], cache.keys[0][slots], cache.values[0][slots], spec
        )
        row += query_len
    return out


def _run(
    backend_name: str,
    step: Step,
    spec: AttentionSpec,
    backend: AttentionBackend | None = None,
    device: torch.device = CPU,
) -> torch.Tensor:
    backend = backend or create_backend(backend_name)
    cache = PagedKVCache(
        1, step.cache.num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, device
    )
    cache.keys.copy_(step.cache.keys)
    cache.values.copy_(step.cache.values)
    metadata = backend.build_metadata(step.layout, device)
    q, k, v = (t.to(device) for t in (step.q, step.k, step.v))
    return backend.forward(q, k, v, cache.layer(0), metadata, spec).cpu()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("release_dead_pages", [False, True])
@pytest.mark.parametrize("decode_form", FLOAT32_DECODE_FORMS)
def test_portable_backend_equals_reference(
    spec: AttentionSpec, release_dead_pages: bool, decode_form: str
) -> None:
    """Decodes (as matmuls, or through SDPA or either form of the C kernel where no softcap asks
    for matmuls), prefill chunks over cached pages and fresh prompts; with a window, also with
    the pages before every window given back (their table entries RELEASED_PAGE, never read)."""
    if decode_form in KERNEL_FORMS and not kernel_form_supported(
        decode_form, CPU, torch.float32, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    ):
        pytest.skip("the paged decode C kernel does not build here (no C compiler)")
    step = _step(spec, release_dead_pages)
    backend = TorchSdpaBackend(decode_form=decode_form)
    torch.testing.assert_close(
        _run("torch_sdpa", step, spec, backend), _reference(step, spec), atol=1e-5, rtol=1e-5
    )


@TRITON_RUNS
@pytest.mark.parametrize("spec", SPECS[:2])
def test_triton_equals_reference(spec: AttentionSpec) -> None:
    """On the GPU where there is one, else in Triton's interpreter."""
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    step = _step(spec, release_dead_pages=True)
    torch.testing.assert_close(
        _run("triton", step, spec, device=device), _reference(step, spec), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("spec", [*SPECS[1:3], SPECS[3]])
@pytest.mark.parametrize("decode_form", FLOAT32_DECODE_FORMS)
def test_decodes_sharing_a_prefix_equal_reference(spec: AttentionSpec, decode_form: str) -> None:
    """Decodes whose tables start with the same three pages: with full attention a cascade
    (shared prefix attended once, merged by log-sum-exp; scale and softcap in both parts; the
    own pages through the decode form where it gives a log-sum-exp), with a window plain
    windowed chunks."""
    if decode_form in KERNEL_FORMS and not kernel_form_supported(
        decode_form, CPU, torch.float32, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    ):
        pytest.skip("the paged decode C kernel does not build here (no C compiler)")
    step = _step(spec, query_lens=(1,) * 4, context_lens=(13, 17, 22, 30), num_shared_pages=3)
    policy = CascadePolicy(min_prefix_tokens=1, min_saved_tokens=1)
    backend = TorchSdpaBackend(policy, decode_form=decode_form)
    metadata = backend.build_metadata(step.layout, CPU)
    assert (metadata.view(spec.sliding_window).cascade is None) == (spec.sliding_window is not None)
    torch.testing.assert_close(
        _run("torch_sdpa", step, spec, backend), _reference(step, spec), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("spec", SPECS[:3])
def test_packed_prefill_without_cache_equals_reference(spec: AttentionSpec) -> None:
    """Whole sequences without a KV cache: padded groups of similar lengths, and singles."""
    lengths = [5, 17, 1, 30, 28, 26, 12]
    generator = torch.Generator().manual_seed(4)
    num_tokens = sum(lengths)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    layout = BatchLayout(lengths, lengths, attention_windows=(spec.sliding_window,))
    backend = create_backend("torch_sdpa")
    metadata = backend.build_metadata(layout, CPU)
    assert metadata.view(spec.sliding_window).packed_groups  # some sequences run padded together
    got = backend.forward(q, k, v, None, metadata, spec)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        expected = _reference_attention(q[rows], k[rows], v[rows], spec)
        torch.testing.assert_close(got[rows], expected, atol=1e-5, rtol=1e-5)
        start += length


def test_metadata_without_the_layers_window_is_an_error() -> None:
    step = _step(FULL_ATTENTION)
    backend = create_backend("torch_sdpa")
    metadata = backend.build_metadata(step.layout, CPU)
    with pytest.raises(ValueError, match="attention_windows"):
        backend.forward(step.q, step.k, step.v, None, metadata, AttentionSpec(sliding_window=4))


def test_c_kernel_backend_refuses_windows_and_auto_falls_back(monkeypatch, tmp_path) -> None:
    # As where the C kernel builds: "auto" would time it for a bf16 model; not for these.
    monkeypatch.setattr(cpu_kernels, "varlen_attention_supported", lambda *args: True)
    monkeypatch.setenv("VACPACK_CHOICE_CACHE", str(tmp_path))
    assert auto_candidates(CPU, torch.bfloat16, 64) == ["cpu_kernels", "torch_sdpa"]
    windowed = (FULL_ATTENTION, AttentionSpec(sliding_window=4096))
    soft_capped = (AttentionSpec(logit_softcap=50.0),)
    bin_shape = PackedBinShape(2, 8)

    def shapes(specs: tuple[AttentionSpec, ...]) -> AttentionShapes:
        return AttentionShapes(4, 2, 64, torch.bfloat16, specs, max_model_len=64)

    with pytest.raises(ValueError, match="sliding window of 4096 tokens"):
        select_backend("cpu_kernels", CPU, shapes(windowed), bin_shape)
    for specs in (windowed, soft_capped):
        selected = select_backend("auto", CPU, shapes(specs), bin_shape)
        # The sole backend that runs every layer, taken without timing (and sequences of at
        # most 64 tokens never reach the blocked prefill: nothing else to choose).
        assert selected.backend.name == "torch_sdpa" and selected.choices == ()
