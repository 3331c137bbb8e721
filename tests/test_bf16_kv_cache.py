"""A KV cache kept in bfloat16 under float32 arithmetic (CPUs without bfloat16 instructions,
where a bfloat16 checkpoint computes in float32): every attention path reads it widened and
computes exactly what it computes on a float32 cache holding the same values; an engine
stores its keys and values rounded, in half the memory, and says so; kv_cache_dtype names
the cache's dtype or refuses one attention cannot read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention_windows import FLOAT32_DECODE_FORMS

from vacpack import LLM, SamplingParams
from vacpack.attention import BatchLayout, create_backend
from vacpack.attention.backend import AttentionSpec
from vacpack.attention.cascade import CascadePolicy
from vacpack.attention.timed_steps import AttentionShapes
from vacpack.config import EngineConfig
from vacpack.cpu_kernels import paged_attention_with_lse, varlen_attention_supported
from vacpack.cpu_kernels.paged_decode import paged_decode_attention, paged_decode_supported
from vacpack.kvcache.paged_cache import KVLayer, PagedKVCache
from vacpack.models import cpu_dtype
from vacpack.runtime import describe_dtypes, resolve_kv_cache_dtype
from vacpack.tuning import force_env_var

CPU = torch.device("cpu")
PAGE_SIZE = 8
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
C_KERNELS_RUN = varlen_attention_supported(CPU, torch.float32, HEAD_DIM) and (
    paged_decode_supported(CPU, torch.float32, HEADS, KV_HEADS, HEAD_DIM)
)
needs_c_kernels = pytest.mark.skipif(
    not C_KERNELS_RUN, reason="the C kernels do not build here (no C compiler)"
)
FLOAT32_ARITHMETIC = dict(dtype="bfloat16", device="cpu", cpu_bf16_arithmetic="float32")


def _bf16_values(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """float32 values that bfloat16 holds exactly: stored in either cache, they are the same."""
    return torch.randn(shape, generator=generator).bfloat16().float()


def _twin_layers(num_slots: int, generator: torch.Generator) -> tuple[KVLayer, KVLayer]:
    """The same keys and values in a bfloat16 cache and in a float32 one."""
    shape = (num_slots, KV_HEADS, HEAD_DIM)
    keys, values = _bf16_values(shape, generator), _bf16_values(shape, generator)
    wide = KVLayer(keys, values, PAGE_SIZE)
    return KVLayer(keys.bfloat16(), values.bfloat16(), PAGE_SIZE), wide


@needs_c_kernels
@pytest.mark.parametrize("heads_in_lanes", [False, True], ids=["heads-apart", "heads-in-lanes"])
def test_the_decode_kernel_reads_a_bfloat16_cache_as_its_float32_values(
    heads_in_lanes: bool,
) -> None:
    generator = torch.Generator().manual_seed(0)
    narrow, wide = _twin_layers(64 * PAGE_SIZE, generator)
    pages = torch.randperm(64, generator=generator).view(4, 16)
    key_ranges = torch.tensor([[0, 1], [0, 17], [5, 90], [0, 128]])
    q = torch.randn(4, HEADS, HEAD_DIM, generator=generator)
    args = (pages, key_ranges, PAGE_SIZE, 0.3, True, heads_in_lanes)
    out, lse = paged_decode_attention(q, narrow.keys, narrow.values, *args)
    expected, expected_lse = paged_decode_attention(q, wide.keys, wide.values, *args)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected) and lse is not None and expected_lse is not None
    assert torch.equal(lse, expected_lse)


@needs_c_kernels
def test_the_varlen_kernel_reads_a_bfloat16_cache_as_its_float32_values() -> None:
    """Decodes, a fresh prefill and a chunk over cached pages in one call."""
    generator = torch.Generator().manual_seed(1)
    narrow, wide = _twin_layers(48 * PAGE_SIZE, generator)
    query_lens, context_lens = [1, 1, 20, 9], [5, 60, 20, 100]
    pages = torch.randperm(48, generator=generator)[:40].view(4, 10)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=generator)
    cu_q = torch.tensor([0, *query_lens]).cumsum(0)
    args = (cu_q, torch.tensor(context_lens), pages, PAGE_SIZE)
    out, lse = paged_attention_with_lse(q, narrow.keys, narrow.values, *args)
    expected, expected_lse = paged_attention_with_lse(q, wide.keys, wide.values, *args)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


def _step_layout(window: int | None) -> tuple[BatchLayout, int]:
    """Six decodes behind one 64-token prefix (a cascade), a fresh prefill and a prefill chunk
    over its cached pages; the cache's slot count."""
    prefix = list(range(8))  # 64 tokens
    tables = [[*prefix, 8 + 2 * i, 9 + 2 * i] for i in range(6)]  # 9..16 own tokens
    tables += [list(range(20, 24)), list(range(24, 34))]
    layout = BatchLayout(
        query_lens=[1] * 6 + [30, 12],
        context_lens=[73 + i for i in range(6)] + [30, 80],
        page_tables=tables,
        page_size=PAGE_SIZE,
        attention_windows=(window,),
    )
    return layout, 34 * PAGE_SIZE


WINDOW = AttentionSpec(sliding_window=24)
# Each backend and form, in full attention and (where it runs windows) a sliding window.
CASES = [
    pytest.param("cpu_kernels", {}, AttentionSpec(), id="cpu_kernels", marks=needs_c_kernels),
    *[
        pytest.param(
            "torch_sdpa",
            {"decode_form": form, "prefix_form": prefix_form},
            spec,
            id=f"torch_sdpa-{form}-prefix-{prefix_form}-{'window' if spec == WINDOW else 'full'}",
            marks=needs_c_kernels if "kernel" in (form + prefix_form) else (),
        )
        for form in FLOAT32_DECODE_FORMS
        for prefix_form in ("matmuls", "kernel")
        if form == "matmuls" or prefix_form == "matmuls"
        for spec in (AttentionSpec(), WINDOW)
    ],
]


@pytest.mark.parametrize(("name", "options", "spec"), CASES)
def test_every_backend_computes_on_a_bfloat16_cache_what_it_does_on_float32(
    name: str, options: dict[str, Any], spec: AttentionSpec
) -> None:
    backend = create_backend(
        name, cascade=CascadePolicy(min_prefix_tokens=16, min_saved_tokens=16), **options
    )
    generator = torch.Generator().manual_seed(2)
    layout, num_slots = _step_layout(spec.sliding_window)
    narrow, wide = _twin_layers(num_slots, generator)
    num_tokens = layout.num_tokens
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=generator)
    k = _bf16_values((num_tokens, KV_HEADS, HEAD_DIM), generator)
    v = _bf16_values((num_tokens, KV_HEADS, HEAD_DIM), generator)
    metadata = backend.build_metadata(layout, CPU)
    out = backend.forward(q, k, v, narrow, metadata, spec)
    expected = backend.forward(q, k, v, wide, metadata, spec)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    # The step's keys were stored, rounded to the cache's dtype.
    assert narrow.keys.dtype == torch.bfloat16 and torch.equal(narrow.keys.float(), wide.keys)


def test_writing_rounds_to_the_caches_dtype() -> None:
    cache = PagedKVCache(1, 2, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, CPU)
    keys = torch.randn(3, KV_HEADS, HEAD_DIM)
    cache.layer(0).write(torch.tensor([0, 5, 9]), keys, -keys)
    assert torch.equal(cache.keys[0, 5], keys[1].bfloat16())
    assert torch.equal(cache.values[0, 9], (-keys[2]).bfloat16())


def test_kv_cache_dtype_resolution() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    cuda = torch.device("cuda")
    # auto: the weights' dtype where attention reads it, else the model's.
    assert resolve_kv_cache_dtype("auto", f32, bf16, CPU) == bf16
    assert resolve_kv_cache_dtype("auto", f32, f32, CPU) == f32
    assert resolve_kv_cache_dtype("auto", bf16, bf16, CPU) == bf16
    assert resolve_kv_cache_dtype("float32", f32, bf16, CPU) == f32
    assert resolve_kv_cache_dtype("bfloat16", f32, f32, CPU) == bf16
    with pytest.raises(ValueError, match="kv_cache_dtype=float32 with bfloat16 arithmetic"):
        resolve_kv_cache_dtype("float32", bf16, bf16, CPU)
    with pytest.raises(ValueError, match="on a CPU"):
        resolve_kv_cache_dtype("bfloat16", f32, f32, cuda)
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto"):
        EngineConfig("m", kv_cache_dtype="fp8")


def test_reports_name_a_cache_kept_in_another_dtype() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert describe_dtypes(f32, f32, f32) == "float32"
    assert describe_dtypes(f32, bf16, bf16) == "bfloat16 weights and KV cache, float32 arithmetic"
    assert describe_dtypes(f32, bf16, f32) == "bfloat16 weights, float32 arithmetic"
    assert describe_dtypes(f32, f32, bf16) == "float32, bfloat16 KV cache"
    shapes = AttentionShapes(HEADS, KV_HEADS, HEAD_DIM, f32, kv_cache_dtype=bf16)
    assert "float32, bfloat16 KV cache" in shapes.key()
    assert "KV cache" not in AttentionShapes(HEADS, KV_HEADS, HEAD_DIM, f32).key()


@pytest.fixture
def _measured_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite pins bfloat16 arithmetic (conftest.py); here it is named per engine."""
    monkeypatch.delenv(force_env_var(cpu_dtype.ARITHMETIC_PHASE), raising=False)


@pytest.mark.usefixtures("_measured_arithmetic")
def test_an_engine_keeps_a_bfloat16_models_cache_in_bfloat16_under_float32_arithmetic(
    tiny_checkpoint,
) -> None:
    model_dir = str(tiny_checkpoint("qwen2"))
    budget = dict(kv_cache_memory_bytes=2**20, block_size=4, max_num_batched_tokens=64)
    narrow = LLM(model_dir, **budget, **FLOAT32_ARITHMETIC)
    wide = LLM(model_dir, **budget, kv_cache_dtype="float32", **FLOAT32_ARITHMETIC)
    assert narrow.engine.kv_cache.keys.dtype == torch.bfloat16
    assert narrow.loaded.dtype == torch.float32
    assert narrow.engine.setup.dtype == "bfloat16 weights and KV cache, float32 arithmetic"
    # Half the bytes a token: twice the pages in the same budget.
    assert narrow.engine.kv_sizing.num_pages == 2 * wide.engine.kv_sizing.num_pages

    generator = torch.Generator().manual_seed(0)
    vocab_size = narrow.loaded.config.vocab_size
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (5, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1)
    got = narrow.generate(prompts, params, use_tqdm=False)
    expected = wide.generate(prompts, params, use_tqdm=False)
    differences = []
    for ours, theirs in zip(got, expected, strict=True):
        for position in range(1, len(ours.prompt_token_ids)):
            token = ours.prompt_token_ids[position]
            differences.append(
                ours.prompt_logprobs[position][token].logprob
                - theirs.prompt_logprobs[position][token].logprob
            )
    # Keys and values rounded to bfloat16 (8 bits) move this tiny model's log-probabilities by
    # 0.006 on average, 0.015 at most: close to the float32 cache's, and not equal to them (the
    # cache is rounded).
    magnitudes = [abs(d) for d in differences]
    assert 0 < max(magnitudes) < 0.05
    assert sum(magnitudes) / len(magnitudes) < 0.02
