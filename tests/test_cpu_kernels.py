"""The C varlen attention kernels (bf16 where the CPU has AVX512-BF16, float32 wherever a C
compiler is) against float32 attention; the backend built on them against the portable one, in
packed corpus batches, engine steps with decodes and cached pages, and whole jobs; and how the
kernel library builds, caches and falls back."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from mixed_step import PREFILL_LEN, mixed_step

from vacpack import LLM, SamplingParams
from vacpack.attention import (
    BatchLayout,
    auto_candidates,
    create_backend,
    resolve_backend_name,
)
from vacpack.attention.cascade import CascadePolicy
from vacpack.attention.cpu_kernel_backend import CpuKernelBackend, PagedStep
from vacpack.cpu_kernels import (
    attend,
    paged_attention,
    paged_attention_with_lse,
    varlen_attention,
    varlen_attention_supported,
)
from vacpack.cpu_kernels.argmax import argmax_rows, argmax_supported
from vacpack.engine.sampler import Sampler, SamplingRow
from vacpack.kvcache.paged_cache import PagedKVCache

CPU = torch.device("cpu")
KERNELS_RUN_HERE = varlen_attention_supported(CPU, torch.bfloat16, 64)
F32_KERNEL_RUNS_HERE = varlen_attention_supported(CPU, torch.float32, 64)
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE, reason="needs an x86 CPU with AVX512-BF16 and a C compiler"
)
# Each test of a kernel runs once per dtype, where that dtype's kernel runs.
DTYPES = [
    pytest.param(torch.bfloat16, marks=needs_kernels, id="bf16"),
    pytest.param(
        torch.float32,
        marks=pytest.mark.skipif(not F32_KERNEL_RUNS_HERE, reason="needs a C compiler"),
        id="f32",
    ),
]
# bf16 inputs and output, probabilities rounded to bf16 before the value product; float32
# differs from the reference only in the order of its sums.
ATOL = {torch.bfloat16: 2e-2, torch.float32: 2e-5}


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens_q: list[int],
    lens_k: list[int],
    causal: bool,
) -> torch.Tensor:
    """Float32 SDPA, one sequence at a time, the queries being each sequence's last tokens."""
    outs, start_q, start_k = [], 0, 0
    for n_q, n_k in zip(lens_q, lens_k, strict=True):
        mask = None
        if causal:
            mask = torch.arange(n_k) <= torch.arange(n_k - n_q, n_k).unsqueeze(1)
        out = F.scaled_dot_product_attention(
            q[start_q : start_q + n_q].float().transpose(0, 1).unsqueeze(0),
            k[start_k : start_k + n_k].float().transpose(0, 1).unsqueeze(0),
            v[start_k : start_k + n_k].float().transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            enable_gqa=True,
        )
        outs.append(out.squeeze(0).transpose(0, 1))
        start_q, start_k = start_q + n_q, start_k + n_k
    return torch.cat(outs)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def _random(
    tokens: int,
    heads: int,
    head_dim: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    return torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)


# (heads, head_dim, causal, lens_q, lens_k): shapes every kernel takes, bf16 ones included.
KERNEL_CASES = [
    # An embedding bin: one-token texts, query chunks of 64 crossed, a 256-token passage.
    pytest.param(
        (12, 12), 32, False, [1, 5, 17, 256, 100], [1, 5, 17, 256, 100], id="embedding-bin"
    ),
    # Fresh causal prefills with grouped heads (Qwen2.5-0.5B's 7 per KV head).
    pytest.param((14, 2), 64, True, [300, 33, 1], [300, 33, 1], id="gqa-causal"),
    # Prefill chunks over cached keys: query i sits at n_k - n_q + i.
    pytest.param((6, 2), 64, True, [40, 7, 1], [300, 7, 129], id="cached-keys"),
    pytest.param((8, 8), 128, False, [70], [70], id="dim128"),
    pytest.param((4, 1), 64, True, [129], [1000], id="mqa-long-context"),
]
CASE_FIELDS = ("heads", "head_dim", "causal", "lens_q", "lens_k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    CASE_FIELDS,
    [
        *KERNEL_CASES,
        # Head sizes only the float32 kernel takes (a multiple of 8, its last 8 dims alone).
        pytest.param((4, 2), 40, True, [70, 1], [70, 9], id="dim40"),
        pytest.param((2, 2), 8, False, [3, 20], [3, 20], id="dim8"),
    ],
)
def test_kernel_equals_float32_attention(dtype, heads, head_dim, causal, lens_q, lens_k) -> None:
    if not varlen_attention_supported(CPU, dtype, head_dim):
        pytest.skip(f"the {dtype} kernel takes no head size of {head_dim}")
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(sum(lens_q) + head_dim)
    q = _random(sum(lens_q), num_heads, head_dim, generator, dtype)
    k = _random(sum(lens_k), num_kv_heads, head_dim, generator, dtype)
    v = _random(sum(lens_k), num_kv_heads, head_dim, generator, dtype)

    out = varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), causal=causal)

    assert out.shape == q.shape and out.dtype == dtype
    expected = _reference(q, k, v, lens_q, lens_k, causal)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_queries_may_be_a_view_into_a_fused_projection(dtype) -> None:
    """A model hands over q, k and v as column slices of one qkv output: rows further apart
    than their heads. The kernel reads them in place and gives the same result."""
    generator = torch.Generator().manual_seed(0)
    lengths, num_heads, num_kv_heads, head_dim = [50, 90], 4, 2, 32
    qkv = torch.randn(sum(lengths), (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q, k, v = qkv.to(dtype).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1
    )
    q = q.view(-1, num_heads, head_dim)
    k, v = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
    assert q.stride(0) != num_heads * head_dim
    cu = _cu(lengths)
    strided = varlen_attention(q, k, v, cu, cu, causal=True)
    dense = varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, causal=True)
    assert torch.equal(strided, dense)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_shapes_are_refused(dtype) -> None:
    q = torch.zeros(10, 4, 32, dtype=dtype)
    kv = torch.zeros(5, 2, 32, dtype=dtype)
    with pytest.raises(ValueError, match="at least as many keys"):
        varlen_attention(q, kv, kv, _cu([10]), _cu([5]), causal=True)
    with pytest.raises(ValueError, match="mismatched shapes"):
        varlen_attention(q, kv[:, :, :16], kv, _cu([10]), _cu([5]), causal=False)
    with pytest.raises(ValueError, match="different numbers of sequences"):
        varlen_attention(q, kv, kv, _cu([5, 5]), _cu([5]), causal=False)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="KV cache"):  # keys and values in two dtypes
        varlen_attention(q, kv.to(other), kv, _cu([10]), _cu([10]), causal=False)


def test_auto_times_the_kernels_only_where_they_run() -> None:
    expected = ["cpu_kernels", "torch_sdpa"] if KERNELS_RUN_HERE else ["torch_sdpa"]
    assert auto_candidates(CPU, torch.bfloat16, 64) == expected
    assert auto_candidates(CPU, torch.bfloat16, 16) == ["torch_sdpa"]
    expected = ["cpu_kernels", "torch_sdpa"] if F32_KERNEL_RUNS_HERE else ["torch_sdpa"]
    assert auto_candidates(CPU, torch.float32, 64) == expected
    assert auto_candidates(CPU, torch.float32, 16) == expected
    assert auto_candidates(CPU, torch.float32, 12) == ["torch_sdpa"]
    assert auto_candidates(CPU, torch.float16, 64) == ["torch_sdpa"]
    assert auto_candidates(CPU) == ["torch_sdpa"]
    assert resolve_backend_name("torch_sdpa", CPU, torch.bfloat16, 64) == "torch_sdpa"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
def test_backend_runs_a_packed_bin_in_one_call(monkeypatch, causal: bool, dtype) -> None:
    calls = []

    def counting(*args, **kwargs) -> torch.Tensor:
        calls.append(args[3].cu_seqlens_q.tolist())
        return attend(*args, **kwargs)

    monkeypatch.setattr("vacpack.attention.cpu_kernel_backend.attend", counting)
    lengths = [3, 200, 1, 64, 65]
    generator = torch.Generator().manual_seed(1)
    q = _random(sum(lengths), 6, 64, generator, dtype)
    k = _random(sum(lengths), 2, 64, generator, dtype)
    v = _random(sum(lengths), 2, 64, generator, dtype)
    layout = BatchLayout(lengths, lengths, causal=causal)

    kernels = create_backend("cpu_kernels")
    out = kernels.forward(q, k, v, None, kernels.build_metadata(layout, CPU))
    portable = create_backend("torch_sdpa")
    reference = portable.forward(q, k, v, None, portable.build_metadata(layout, CPU))

    assert calls == [_cu(lengths).tolist()]
    expected = _reference(q, k, v, lengths, lengths, causal)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)
    torch.testing.assert_close(out.float(), reference.float(), atol=ATOL[dtype], rtol=0)


@dataclass(frozen=True)
class ScatteredPages:
    """Decodes, a fresh prefill and a prefill chunk over cached pages, with pages scattered
    through the cache: 14 query heads over 2 KV heads of 64 dims."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    page_table: torch.Tensor  # [seqs, most pages] padded with page 0
    slots: list[torch.Tensor]  # each sequence's cache slots, in order
    page_size: int

    @classmethod
    def random(cls, page_size: int, dtype: torch.dtype) -> ScatteredPages:
        generator = torch.Generator().manual_seed(page_size)
        query_lens, context_lens = [1, 1, 1, 77, 30], [1, 200, 33, 77, 130]
        pages_per_seq = [-(-n // page_size) for n in context_lens]
        num_pages = sum(pages_per_seq)
        shape = (num_pages * page_size, 2, 64)
        key_cache = torch.randn(shape, generator=generator).to(dtype)
        value_cache = torch.randn(shape, generator=generator).to(dtype)
        order = torch.randperm(num_pages, generator=generator).tolist()
        tables = [order[sum(pages_per_seq[:i]) :][:n] for i, n in enumerate(pages_per_seq)]
        page_table = torch.zeros(len(tables), max(pages_per_seq), dtype=torch.int64)
        for row, pages in enumerate(tables):
            page_table[row, : len(pages)] = torch.tensor(pages)
        slots = [
            (torch.tensor(pages).unsqueeze(1) * page_size + torch.arange(page_size)).flatten()[:n]
            for pages, n in zip(tables, context_lens, strict=True)
        ]
        q = _random(sum(query_lens), 14, 64, generator, dtype)
        return cls(
            q, key_cache, value_cache, query_lens, context_lens, page_table, slots, page_size
        )

    def arguments(self) -> tuple[object, ...]:
        """paged_attention's positional arguments."""
        context_lens = torch.tensor(self.context_lens)
        cu_q = _cu(self.query_lens)
        caches = (self.key_cache, self.value_cache)
        return (self.q, *caches, cu_q, context_lens, self.page_table, self.page_size)

    def expected(self) -> torch.Tensor:
        """Float32 attention of each sequence over its own slots."""
        every = torch.cat(self.slots)
        keys, values = self.key_cache[every], self.value_cache[every]
        return _reference(self.q, keys, values, self.query_lens, self.context_lens, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [8, 16, 48], ids=["page8", "page16", "page48"])
def test_paged_attention_reads_keys_in_place(page_size: int, dtype) -> None:
    """Decodes, a fresh prefill and a prefill chunk over cached pages in one call, with pages
    scattered through the cache: each sequence equals float32 attention over its own slots.
    8-token pages put every 16-key block across two pages; 48-token pages hold three blocks."""
    step = ScatteredPages.random(page_size, dtype)
    out = paged_attention(*step.arguments())
    torch.testing.assert_close(out.float(), step.expected(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cached_tokens", [0, 90], ids=["fresh", "over-cached-pages"])
def test_backend_runs_an_engine_step_in_one_call(monkeypatch, cached_tokens, dtype) -> None:
    """A decode and a 300-token prefill in one step: one kernel call over the cache, after this
    step's keys and values were written there; the prefill equals float32 attention over its
    slots and the decode the portable backend's."""
    calls = []

    def counting(*args, **kwargs) -> torch.Tensor:
        calls.append(args[3].cu_seqlens_q.tolist())
        return attend(*args, **kwargs)

    monkeypatch.setattr("vacpack.attention.cpu_kernel_backend.attend", counting)
    step = mixed_step(cached_tokens, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
    kernels = create_backend("cpu_kernels")
    metadata = kernels.build_metadata(step.layout, CPU)

    def rebuilt(*args, **kwargs):
        raise AssertionError("a layer rebuilt the step's sequences")

    # Built and checked once per step, in build_metadata; every layer's forward reuses them.
    monkeypatch.setattr("vacpack.cpu_kernels.attention._checked", rebuilt)
    out = kernels.forward(step.q, step.k, step.v, step.layer, metadata)

    assert calls == [[0, 1, 1 + PREFILL_LEN]]
    keys, values = step.layer.keys[step.prefill_slots], step.layer.values[step.prefill_slots]
    assert torch.equal(keys[cached_tokens:], step.k[1:]), "new keys are in the cache"
    expected = _reference(step.q[1:], keys, values, [PREFILL_LEN], [step.context_len], True)
    torch.testing.assert_close(out[1:].float(), expected, atol=ATOL[dtype], rtol=0)
    portable = create_backend("torch_sdpa")
    decode = portable.forward(
        step.q, step.k, step.v, step.layer, portable.build_metadata(step.layout, CPU)
    )[:1]
    torch.testing.assert_close(out[:1].float(), decode.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_sum_exp_is_each_rows_over_its_keys(dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    page_size, num_heads, num_kv_heads, head_dim = 16, 4, 2, 32
    context_lens = [40, 5]
    key_cache = torch.randn(64, num_kv_heads, head_dim, generator=generator).to(dtype)
    value_cache = torch.randn(64, num_kv_heads, head_dim, generator=generator).to(dtype)
    page_tables = torch.tensor([[3, 0, 2], [1, 0, 0]])
    q = _random(2, num_heads, head_dim, generator, dtype)

    _, lse = paged_attention_with_lse(
        q, key_cache, value_cache, _cu([1, 1]), torch.tensor(context_lens), page_tables, page_size
    )

    for row, (pages, n) in enumerate(zip(page_tables.tolist(), context_lens, strict=True)):
        slots = (torch.tensor(pages).unsqueeze(1) * page_size + torch.arange(page_size)).flatten()
        keys = key_cache[slots[:n]].float().repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", q[row].float(), keys) * head_dim**-0.5
        torch.testing.assert_close(lse[row], scores.logsumexp(-1), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decodes_sharing_a_prefix_run_as_a_cascade(dtype) -> None:
    check_cascade(dtype)


def check_cascade(dtype: torch.dtype, **options: str) -> None:
    """Six decodes whose page tables start with the same 20 pages (and two that share nothing):
    the cascade (prefix once per group, own pages apart, merged by log-sum-exp) equals every
    decode reading its whole context, and float32 attention; through the backend built with
    `options` (which kernels run the own pages and the prefixes)."""
    page_size, num_heads, num_kv_heads, head_dim = 16, 14, 2, 64
    generator = torch.Generator().manual_seed(4)
    prefix = list(range(20))
    own_lens = [1, 17, 40, 33, 16, 70]
    tables, context_lens, next_page = [], [], 20
    for own in own_lens:
        own_pages = -(-own // page_size)
        tables.append(prefix + list(range(next_page, next_page + own_pages)))
        context_lens.append(len(prefix) * page_size + own)
        next_page += own_pages
    for alone in (90, 300):
        tables.append(list(range(next_page, next_page + -(-alone // page_size))))
        context_lens.append(alone)
        next_page += len(tables[-1])
    cache = PagedKVCache(1, next_page, page_size, num_kv_heads, head_dim, dtype, "cpu")
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    layer = cache.layer(0)
    layout = BatchLayout([1] * len(tables), context_lens, tables, page_size)
    q = _random(len(tables), num_heads, head_dim, generator, dtype)
    k = _random(len(tables), num_kv_heads, head_dim, generator, dtype)
    v = _random(len(tables), num_kv_heads, head_dim, generator, dtype)

    policy = CascadePolicy(min_prefix_tokens=1, min_saved_tokens=1)
    cascading = CpuKernelBackend(policy, **options)
    metadata = cascading.build_metadata(layout, CPU)
    assert isinstance(metadata, PagedStep) and metadata.cascade is not None
    assert sorted(metadata.cascade.rows.tolist()) == list(range(len(own_lens)))
    out = cascading.forward(q, k, v, layer, metadata)
    plain = CpuKernelBackend(cascade=None, bf16_kernel=options.get("bf16_kernel", "avx512_bf16"))
    whole = plain.forward(q, k, v, layer, plain.build_metadata(layout, CPU))

    torch.testing.assert_close(out.float(), whole.float(), atol=ATOL[dtype], rtol=0)
    slots = torch.cat(
        [
            (torch.tensor(t).unsqueeze(1) * page_size + torch.arange(page_size)).flatten()[:n]
            for t, n in zip(tables, context_lens, strict=True)
        ]
    )
    expected = _reference(
        q, layer.keys[slots], layer.values[slots], [1] * len(tables), context_lens, causal=True
    )
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@needs_kernels
def test_a_bf16_decoder_gives_the_same_greedy_tokens_and_scores(tiny_checkpoint) -> None:
    """A tiny Qwen2 with 32-dim heads in bf16, every step on the C kernels' backend: the same
    greedy tokens and document scores as the portable backend, and as "auto" (which runs each
    phase on whichever won its timing: a busy host can tip that, so which one is not asserted
    here; tests/test_measured_selection.py checks the choosing)."""
    model_dir = str(tiny_checkpoint("qwen2", head_dim=32, hidden_size=128))
    prompts = [" ".join(["word"] * n) + " end" for n in (1, 3, 40, 90, 150, 7, 64, 33)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for backend in ("cpu_kernels", "torch_sdpa", "auto"):
        llm = LLM(model_dir, dtype="bfloat16", attention_backend=backend, block_size=16)
        assert backend == "auto" or llm.engine.attention.name == backend
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scores = llm.loglikelihood(prompts, use_tqdm=False)
        results[backend] = ([o.outputs[0].token_ids for o in outputs], scores)
    for ours in ("cpu_kernels", "auto"):
        assert results[ours][0] == results["torch_sdpa"][0], ours
        for score, portable in zip(results[ours][1], results["torch_sdpa"][1], strict=True):
            assert score.num_tokens == portable.num_tokens
            assert abs(score.logprob - portable.logprob) <= 0.02 * max(1.0, abs(portable.logprob))


@pytest.mark.skipif(not F32_KERNEL_RUNS_HERE, reason="needs a C compiler")
def test_a_float32_decoder_on_the_kernel_equals_the_portable_backend(tiny_checkpoint) -> None:
    """A tiny Qwen2 in float32 with grouped 16-dim heads, every step on the float32 kernel:
    the same greedy tokens and document scores as the portable backend."""
    model_dir = str(tiny_checkpoint("qwen2", head_dim=16, hidden_size=64))
    prompts = [" ".join(["word"] * n) + " end" for n in (1, 3, 40, 90, 150, 7, 64, 33)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for backend in ("cpu_kernels", "torch_sdpa"):
        llm = LLM(model_dir, dtype="float32", attention_backend=backend, block_size=16)
        assert llm.engine.attention.name == backend
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scores = llm.loglikelihood(prompts, use_tqdm=False)
        results[backend] = ([o.outputs[0].token_ids for o in outputs], scores)
    assert results["cpu_kernels"][0] == results["torch_sdpa"][0]
    for ours, portable in zip(results["cpu_kernels"][1], results["torch_sdpa"][1], strict=True):
        assert ours.num_tokens == portable.num_tokens
        assert abs(ours.logprob - portable.logprob) <= 1e-4 * max(1.0, abs(portable.logprob))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_argmax_equals_torch_on_ties_infinities_nans_and_strides(dtype) -> None:
    if not argmax_supported(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"the {dtype} argmax kernel does not build here")
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 151936, generator=generator).to(dtype)
    logits[1] = float("-inf")  # all equal: index 0
    logits[2, 70_000] = logits[2, 90_000] = 50.0  # a tie: the first
    logits[3, 5] = float("nan")  # a NaN wins where it stands
    logits[4, 151_935] = 99.0  # in the tail past the last whole vector
    logits[5, 100_000] = float("nan")  # a NaN after the maximum still wins
    logits[5, 10] = 99.0
    short = torch.randn(3, 13, generator=generator).to(dtype)
    strided = torch.randn(4, 300, generator=generator).to(dtype)[:, 7:250]
    ties = torch.randint(-2, 2, (16, 37), generator=generator).to(dtype)  # ties across lanes
    for x in (logits, short, strided, ties):
        assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))


def test_plain_greedy_rows_skip_the_float32_copy(monkeypatch) -> None:
    """The sampler takes bf16 logits: greedy rows without penalties or logprobs go straight to
    the argmax, and equal what the float32 path picks; a row with a penalty takes that path."""
    generator = torch.Generator().manual_seed(6)
    vocab_size = 1000
    logits = torch.randn(4, vocab_size, generator=generator).bfloat16()
    sampler = Sampler(vocab_size, CPU, seed=0)

    def rows(**params) -> list[SamplingRow]:
        return [
            SamplingRow(SamplingParams(temperature=0, **params), (1, 2), (3,), None, frozenset())
            for _ in range(4)
        ]

    widened = []
    original_float = torch.Tensor.float

    def counting_float(self: torch.Tensor) -> torch.Tensor:
        widened.append(tuple(self.shape))
        return original_float(self)

    monkeypatch.setattr(torch.Tensor, "float", counting_float)
    plain = sampler(logits, rows()).sampled_token_ids
    assert (4, vocab_size) not in widened
    penalized = sampler(logits, rows(presence_penalty=0.5)).sampled_token_ids
    assert (4, vocab_size) in widened
    assert torch.equal(plain, original_float(logits).argmax(dim=-1))
    assert plain.dtype == penalized.dtype == torch.int64
