"""The Triton backend equals the portable SDPA backend: random ragged batches and a whole model.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (slow, so shapes are tiny);
tests/conftest.py switches the interpreter on before triton is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton_marks import ON_CPU, TRITON_RUNS

pytest.importorskip("triton")
pytestmark = TRITON_RUNS

from vacpack import LLM, SamplingParams  # noqa: E402
from vacpack.attention import (  # noqa: E402
    BatchLayout,
    auto_candidates,
    create_backend,
    resolve_backend_name,
)
from vacpack.attention.triton_backend import (  # noqa: E402
    TritonBackend,
    VarlenMetadata,
    find_varlen_attention,
)
from vacpack.attention.triton_paged import PagedKernelConfig, paged_attention  # noqa: E402
from vacpack.kvcache.paged_cache import PagedKVCache  # noqa: E402

DEVICES = [
    pytest.param("cpu", marks=ON_CPU),
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
    ),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class RaggedBatch:
    layout: BatchLayout
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], this step's keys
    v: torch.Tensor
    cache: PagedKVCache  # earlier tokens already written


def _ragged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> RaggedBatch:
    """Sequences with shuffled pages and random cached keys and values before this step."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-c // page_size) for c in context_lens]
    # Spare pages, so that a page table reads past its context only into other pages' data.
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=generator).tolist()
    page_tables, start = [], 0
    for count in pages_per_seq:
        page_tables.append(order[start : start + count])
        start += count
    cache = PagedKVCache(1, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    num_tokens = sum(query_lens)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, head_dim, generator=generator).to(device, dtype)

    layout = BatchLayout(query_lens, context_lens, page_tables, page_size)
    return RaggedBatch(layout, rand(num_heads), rand(num_kv_heads), rand(num_kv_heads), cache)


def _clone_cache(cache: PagedKVCache) -> PagedKVCache:
    copy = PagedKVCache(
        cache.keys.shape[0], cache.num_pages, cache.page_size, cache.keys.shape[2],
        cache.keys.shape[3], cache.keys.dtype, cache.keys.device,
    )  # fmt: skip
    copy.keys.copy_(cache.keys)
    copy.values.copy_(cache.values)
    return copy


def _run(backend_name: str, batch: RaggedBatch) -> tuple[torch.Tensor, PagedKVCache]:
    backend = create_backend(backend_name)
    cache = _clone_cache(batch.cache)
    metadata = backend.build_metadata(batch.layout, batch.q.device)
    out = backend.forward(batch.q, batch.k, batch.v, cache.layer(0), metadata)
    return out, cache


# Decodes of different context lengths (one a single token, some across page edges), prefill
# chunks over a cached prefix, and a fresh prompt.
QUERY_LENS = [1, 1, 1, 1, 6, 13, 9]
CONTEXT_LENS = [1, 7, 16, 37, 6, 29, 24]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
def test_triton_equals_portable_on_ragged_batches(
    device: str, dtype: torch.dtype, page_size: int, num_heads: int, num_kv_heads: int
) -> None:
    batch = _ragged_batch(
        QUERY_LENS, CONTEXT_LENS, page_size=page_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=16, dtype=dtype, device=device,
    )  # fmt: skip
    expected, expected_cache = _run("torch_sdpa", batch)
    got, got_cache = _run("triton", batch)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(got_cache.keys, expected_cache.keys, atol=0, rtol=0)
    torch.testing.assert_close(got_cache.values, expected_cache.values, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_decode_equals_portable(device: str) -> None:
    """Flash-decoding: contexts cut into 3 ranges (some empty for short contexts), then merged."""
    query_lens, context_lens = [1, 1, 1], [1, 20, 70]
    batch = _ragged_batch(
        query_lens, context_lens, page_size=4, num_heads=8, num_kv_heads=2, head_dim=24,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    expected, _ = _run("torch_sdpa", batch)
    metadata = TritonBackend().build_metadata(batch.layout, batch.q.device)
    cache = _clone_cache(batch.cache)
    cache.layer(0).write(metadata.slot_mapping, batch.k, batch.v)
    got = torch.empty_like(batch.q)
    paged_attention(
        got, batch.q, cache.keys[0], cache.values[0], metadata.cu_seqlens_q,
        metadata.context_lens, metadata.page_table, first_seq=0, num_seqs=3, max_query_len=1,
        page_size=4, scale=24**-0.5, num_kv_splits=3,
        config=PagedKernelConfig(block_rows=16, tokens_per_block=1, block_kv_tokens=16),
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_bins_without_cache_equal_portable(device: str, causal: bool) -> None:
    """On CUDA through the varlen kernel (bfloat16); on a CPU through the portable backend."""
    lengths = [5, 17, 1, 64, 30]
    generator = torch.Generator().manual_seed(3)
    layout = BatchLayout(lengths, lengths, causal=causal)

    def rand(heads: int) -> torch.Tensor:
        tensor = torch.randn(sum(lengths), heads, 64, generator=generator)
        return tensor.to(device, torch.bfloat16)

    q, k, v = rand(8), rand(2), rand(2)
    portable = create_backend("torch_sdpa")
    expected = portable.forward(q, k, v, None, portable.build_metadata(layout, q.device))
    backend = TritonBackend()
    metadata = backend.build_metadata(layout, q.device)
    if device == "cuda" and find_varlen_attention() is not None:
        assert isinstance(metadata, VarlenMetadata)
    got = backend.forward(q, k, v, None, metadata)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_auto_picks_triton_only_on_cuda() -> None:
    assert auto_candidates(torch.device("cpu")) == ["torch_sdpa"]
    assert auto_candidates(torch.device("cuda")) == ["triton", "torch_sdpa"]
    assert resolve_backend_name("torch_sdpa", torch.device("cuda")) == "torch_sdpa"


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generation_with_triton_equals_portable(tiny_checkpoint, device: str) -> None:
    """Chunked prefill, mixed steps and decodes of a whole model (on a CPU in the interpreter)."""
    model_dir = tiny_checkpoint("qwen2")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (3, 11, 26)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch_sdpa", "triton"):
        llm = LLM(
            str(model_dir), dtype="float32", device=device, attention_backend=backend,
            block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
            kv_cache_memory_bytes=1 << 20, max_model_len=64,
        )  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
        steps = llm.engine.timeline.steps
        assert any(0 < s.num_decode_tokens < s.num_tokens for s in steps)
    assert tokens["triton"] == tokens["torch_sdpa"]


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 5, 7])
def test_step_metadata_views_start_16_byte_aligned(num_seqs: int) -> None:
    """Triton compiles a kernel variant per pointer alignment: every view into the step's one
    packed copy starts 16-byte aligned whatever the number of sequences, so no step compiles
    a new variant (2 s each on an H100)."""
    layout = BatchLayout(
        query_lens=[1] * (num_seqs - 1) + [5],
        context_lens=[3 + 7 * i for i in range(num_seqs)],
        page_tables=[list(range(10 * i, 10 * i + -(-(3 + 7 * i) // 4))) for i in range(num_seqs)],
        page_size=4,
    )
    metadata = TritonBackend().build_metadata(layout, torch.device("cpu"))
    for view in (metadata.cu_seqlens_q, metadata.context_lens, metadata.page_table):
        assert view.data_ptr() % 16 == 0
    assert metadata.context_lens.tolist() == list(layout.context_lens)
    assert metadata.page_table[-1, : len(layout.page_tables[-1])].tolist() == list(
        layout.page_tables[-1]
    )
