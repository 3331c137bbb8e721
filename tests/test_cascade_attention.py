"""Paged decode and cascade (shared-prefix) attention equal per-sequence SDPA over the gathered
context, and greedy outputs stay the same with the prefix cache (and so cascades) on or off."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from shared_prompts import shared_prefix_prompts

from vacpack import LLM, SamplingParams
from vacpack.attention import cascade as cascade_module
from vacpack.attention import paged_decode, torch_sdpa
from vacpack.attention.backend import BatchLayout
from vacpack.attention.cascade import PREFIX_FORMS, CascadePolicy, merge_by_lse
from vacpack.attention.paged_decode import (
    KeyPadding,
    attend,
    build_chunk,
    build_chunks,
    plan_chunks,
)
from vacpack.attention.shared_prefix import SharedPrefix, find_shared_prefixes
from vacpack.attention.torch_sdpa import SdpaMetadata, TorchSdpaBackend
from vacpack.cpu_kernels import varlen_attention_supported
from vacpack.kvcache.paged_cache import KVLayer

PAGE_SIZE = 4
HEAD_DIM = 16
NUM_PAGES = 400
CPU = torch.device("cpu")
# (atol, rtol): bf16 rounds probabilities and outputs to 8 bits, so about one bf16 ulp.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-8, 2**-7)}


@dataclass(frozen=True)
class DecodeBatch:
    page_tables: list[list[int]]
    context_lens: list[int]
    shared_prefixes: list[tuple[int, ...]]  # the pages each sequence shares; () for none

    @property
    def layout(self) -> BatchLayout:
        num_seqs = len(self.context_lens)
        return BatchLayout([1] * num_seqs, self.context_lens, self.page_tables, PAGE_SIZE)


def _decode_batch(
    groups: list[tuple[int, int]], num_unshared: int, generator: torch.Generator
) -> DecodeBatch:
    """groups: (sequences, shared pages) each; every sequence then owns 1..14 more tokens, so
    its last page is often partial. Pages come from a shuffled pool, as after much reuse; the
    pool's last 8 pages are left for tests to use."""
    free = torch.randperm(NUM_PAGES - 8, generator=generator).tolist()
    prefixes = []
    for count, num_pages in groups:
        pages = tuple(free.pop() for _ in range(num_pages))
        prefixes += [pages] * count
    prefixes += [()] * num_unshared
    order = torch.randperm(len(prefixes), generator=generator).tolist()  # members interleaved
    prefixes = [prefixes[i] for i in order]
    tables, context_lens = [], []
    for prefix in prefixes:
        own = int(torch.randint(1, 15, (1,), generator=generator))
        tables.append([*prefix, *(free.pop() for _ in range(-(-own // PAGE_SIZE)))])
        context_lens.append(len(prefix) * PAGE_SIZE + own)
    return DecodeBatch(tables, context_lens, prefixes)


def _kv_layer(dtype: torch.dtype, num_kv_heads: int, generator: torch.Generator) -> KVLayer:
    shape = (NUM_PAGES * PAGE_SIZE, num_kv_heads, HEAD_DIM)
    keys = torch.randn(shape, generator=generator).to(dtype)
    return KVLayer(keys, torch.randn(shape, generator=generator).to(dtype), PAGE_SIZE)


def _reference(
    q: torch.Tensor, kv_layer: KVLayer, page_table: list[int], context_len: int
) -> torch.Tensor:
    """One sequence's query rows [tokens, heads, dim] against its gathered context, in float32,
    causal over the last len(q) positions."""
    offsets = torch.arange(PAGE_SIZE)
    slots = (torch.tensor(page_table).unsqueeze(1) * PAGE_SIZE + offsets).flatten()[:context_len]
    keys = kv_layer.keys[slots].float().transpose(0, 1)
    values = kv_layer.values[slots].float().transpose(0, 1)
    positions = torch.arange(context_len - q.shape[0], context_len).unsqueeze(1)
    mask = torch.arange(context_len) <= positions
    attn = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
    )
    return attn.transpose(0, 1)


def _run_decodes(
    backend: TorchSdpaBackend,
    batch: DecodeBatch,
    kv_layer: KVLayer,
    num_heads: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, SdpaMetadata]:
    num_seqs = len(batch.context_lens)
    num_kv_heads, dtype = kv_layer.keys.shape[1], kv_layer.keys.dtype
    q = torch.randn(num_seqs, num_heads, HEAD_DIM, generator=generator).to(dtype)
    k = torch.randn(num_seqs, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    v = torch.randn(num_seqs, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    metadata = backend.build_metadata(batch.layout, CPU)
    return q, backend.forward(q, k, v, kv_layer, metadata), metadata


# Cascades for any prefix of at least one page shared by two sequences, so that small test
# batches take the cascade path.
ALWAYS = CascadePolicy(min_prefix_tokens=1, min_saved_tokens=1)


GROUPINGS = {
    "one group": ([(6, 5)], 0),
    "groups and loners": ([(3, 1), (4, 7), (2, 12)], 5),
    "no sharing": ([], 7),
    "one long prefix": ([(9, 30)], 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("grouping", list(GROUPINGS), ids=list(GROUPINGS))
@pytest.mark.parametrize(
    "prefix_form", [None, *PREFIX_FORMS], ids=["paged", "cascade", "cascade-kernel"]
)
def test_decodes_equal_per_sequence_sdpa(dtype, heads, grouping, prefix_form) -> None:
    """Every decode reads its own context (prefix_form None), or a cascade attends the shared
    prefixes as matmuls or through the C varlen kernel (where it runs for the dtype)."""
    if prefix_form == "kernel" and not varlen_attention_supported(CPU, dtype, HEAD_DIM):
        pytest.skip(f"the C attention kernel does not run {dtype} here")
    generator = torch.Generator().manual_seed(len(grouping) + heads[0])
    num_heads, num_kv_heads = heads
    groups, num_unshared = GROUPINGS[grouping]
    batch = _decode_batch(groups, num_unshared, generator)
    kv_layer = _kv_layer(dtype, num_kv_heads, generator)
    cascade = prefix_form is not None
    backend = TorchSdpaBackend(ALWAYS if cascade else None, prefix_form=prefix_form or "matmuls")
    q, out, metadata = _run_decodes(backend, batch, kv_layer, num_heads, generator)
    assert (metadata.cascade is not None) == (cascade and bool(groups))
    if metadata.cascade is not None:
        uses_kernel = [g.kernel_prefix is not None for g in metadata.cascade.groups]
        assert set(uses_kernel) == {prefix_form == "kernel"}
    for i, (table, context_len) in enumerate(
        zip(batch.page_tables, batch.context_lens, strict=True)
    ):
        want = _reference(q[i : i + 1], kv_layer, table, context_len)
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(out[i : i + 1].float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "paged"])
def test_many_small_chunks_equal_per_sequence_sdpa(monkeypatch, cascade) -> None:
    """Decodes in many chunks, and shared prefixes attended a few query rows at a time."""
    monkeypatch.setattr(
        paged_decode, "plan_chunks", functools.partial(plan_chunks, budget_tokens=20)
    )
    # 2 KV heads: 3 rows per block against the 12-token prefix, 1 against the 24-token one.
    monkeypatch.setattr(cascade_module, "PREFIX_BLOCK_SCORES", 2 * 12 * 3)
    generator = torch.Generator().manual_seed(7)
    batch = _decode_batch([(5, 3), (3, 6)], 6, generator)
    kv_layer = _kv_layer(torch.float32, 2, generator)
    q, out, metadata = _run_decodes(
        TorchSdpaBackend(ALWAYS if cascade else None), batch, kv_layer, 4, generator
    )
    chunks = metadata.decode_chunks + (metadata.cascade.suffix_chunks if cascade else ())
    assert len(chunks) > 4
    for i, (table, context_len) in enumerate(
        zip(batch.page_tables, batch.context_lens, strict=True)
    ):
        want = _reference(q[i : i + 1], kv_layer, table, context_len)
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)


def test_kernel_form_runs_all_decodes_as_one_chunk_and_builds_masks_only_when_asked() -> None:
    """The C kernel reads pages in place, so its decodes are one chunk, longest first, with no
    padding masks; a soft-capped layer's matmuls get the masks the other forms build."""
    num_keys, hidden = [5, 30, 7, 22], [0, 3, 0, 1]
    runs = [list(range(100 + 10 * i, 108 + 10 * i)) for i in range(4)]
    (kernel_chunk,) = build_chunks([4, 5, 6, 7], runs, num_keys, PAGE_SIZE, CPU, "kernel", hidden)
    assert kernel_chunk.rows.tolist() == [5, 7, 6, 4]
    assert kernel_chunk.key_ranges.tolist() == [[3, 30], [1, 22], [0, 7], [0, 5]]
    assert kernel_chunk.padding is None and kernel_chunk.visible is None
    assert kernel_chunk.pages.view(4, -1)[3].tolist() == [100, 101, 0, 0, 0, 0, 0, 0]
    order = [1, 3, 2, 0]
    masked = build_chunk(
        [4 + i for i in order],
        [runs[i] for i in order],
        [num_keys[i] for i in order],
        PAGE_SIZE,
        CPU,
        [hidden[i] for i in order],
    )
    rebuilt = kernel_chunk.with_masks()
    assert rebuilt.padding is not None and masked.padding is not None
    assert rebuilt.padding.first_padded_key == masked.padding.first_padded_key
    assert torch.equal(rebuilt.padding.mask, masked.padding.mask)
    assert torch.equal(rebuilt.visible, masked.visible)
    assert torch.equal(rebuilt.pages, masked.pages)
    (matmul_chunk,) = build_chunks([0, 1, 2, 3], runs, num_keys, PAGE_SIZE, CPU, "matmuls")
    assert matmul_chunk.has_masks and matmul_chunk.padding is not None


def test_plan_chunks_caps_padded_keys_longest_first() -> None:
    assert plan_chunks([5, 100, 7, 60, 61, 3], budget_tokens=130) == [[1], [4, 3], [2, 0, 5]]
    assert plan_chunks([500, 2], budget_tokens=130) == [[0], [1]]  # too long still runs, alone
    assert plan_chunks([], budget_tokens=130) == []


def test_groups_follow_the_shared_pages() -> None:
    generator = torch.Generator().manual_seed(0)
    batch = _decode_batch([(3, 2), (4, 6)], 3, generator)
    metadata = TorchSdpaBackend(ALWAYS).build_metadata(batch.layout, CPU)
    groups = {
        (tuple(sorted(g.rows.tolist())), g.num_prefix_tokens) for g in metadata.cascade.groups
    }
    members: dict[tuple[int, ...], list[int]] = {}
    for i, prefix in enumerate(batch.shared_prefixes):
        if prefix:
            members.setdefault(prefix, []).append(i)
    assert groups == {(tuple(rows), len(prefix) * PAGE_SIZE) for prefix, rows in members.items()}
    rows_planned = sorted(
        row for chunks in (metadata.decode_chunks, metadata.cascade.suffix_chunks)
        for chunk in chunks for row in chunk.rows.tolist()
    )  # fmt: skip
    assert rows_planned == list(range(len(batch.context_lens)))  # each decode exactly once


def test_the_default_policy_cascades_only_long_prefixes_shared_widely() -> None:
    generator = torch.Generator().manual_seed(1)
    backend = TorchSdpaBackend()
    short = _decode_batch([(20, 60)], 2, generator)  # 240 tokens: too short, however shared
    assert backend.build_metadata(short.layout, CPU).cascade is None
    few = _decode_batch([(2, 128)], 2, generator)  # a 512-token prefix saves only 512 reads
    assert backend.build_metadata(few.layout, CPU).cascade is None
    many = _decode_batch([(10, 128)], 2, generator)
    (group,) = backend.build_metadata(many.layout, CPU).cascade.groups
    assert (group.rows.shape[0], group.num_prefix_tokens) == (10, 512)


def test_a_step_mixing_cascaded_decodes_and_a_cached_prefill() -> None:
    generator = torch.Generator().manual_seed(2)
    batch = _decode_batch([(3, 4)], 2, generator)
    kv_layer = _kv_layer(torch.float32, 2, generator)
    # A prefill chunk of 6 tokens whose first 9 are cached, in pages of its own.
    prefill_table = list(range(NUM_PAGES - 4, NUM_PAGES))
    num_decodes = len(batch.context_lens)
    layout = BatchLayout(
        [1] * num_decodes + [6],
        [*batch.context_lens, 15],
        [*batch.page_tables, prefill_table],
        PAGE_SIZE,
    )
    num_tokens = num_decodes + 6
    q = torch.randn(num_tokens, 4, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, 2, HEAD_DIM, generator=generator)
    v = torch.randn(num_tokens, 2, HEAD_DIM, generator=generator)
    backend = TorchSdpaBackend(ALWAYS)
    metadata = backend.build_metadata(layout, CPU)
    assert metadata.cascade is not None
    out = backend.forward(q, k, v, kv_layer, metadata)
    for i in range(num_decodes):
        want = _reference(q[i : i + 1], kv_layer, batch.page_tables[i], batch.context_lens[i])
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=0)
    want = _reference(q[num_decodes:], kv_layer, prefill_table, 15)
    torch.testing.assert_close(out[num_decodes:], want, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ the pieces


def test_merging_two_halves_by_lse_equals_attention_over_both() -> None:
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(3, 5, HEAD_DIM, generator=generator) * 3  # peaked softmaxes too
    keys = torch.randn(3, 40, HEAD_DIM, generator=generator)
    values = torch.randn(3, 40, HEAD_DIM, generator=generator)
    whole, whole_lse = attend(queries, keys, values, with_lse=True)
    first, first_lse = attend(queries, keys[:, :13], values[:, :13], with_lse=True)
    rest, rest_lse = attend(queries, keys[:, 13:], values[:, 13:], with_lse=True)
    torch.testing.assert_close(merge_by_lse(first, first_lse, rest, rest_lse), whole)
    scores = queries @ keys.transpose(1, 2) * HEAD_DIM**-0.5
    torch.testing.assert_close(whole_lse, torch.logsumexp(scores, dim=-1))


def test_bf16_attention_keeps_large_scores_precise() -> None:
    """Scores in the tens, as trained models have: rounding them to bf16 would shift weights by
    several percent; attend keeps them to float32 precision, as SDPA's CPU kernel does."""
    generator = torch.Generator().manual_seed(6)
    queries = (torch.randn(4, 7, 64, generator=generator) * 6).bfloat16()
    keys = torch.randn(4, 200, 64, generator=generator).bfloat16()
    values = torch.randn(4, 200, 64, generator=generator).bfloat16()
    out, lse = attend(queries, keys, values, with_lse=True)
    scores = queries.float() @ keys.float().transpose(1, 2) / 8
    assert scores.abs().max() > 20
    want = F.scaled_dot_product_attention(queries.float(), keys.float(), values.float())
    torch.testing.assert_close(out.float(), want, atol=2**-6, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-3, rtol=0)


def test_padding_hides_keys() -> None:
    generator = torch.Generator().manual_seed(4)
    queries = torch.randn(2, 3, HEAD_DIM, generator=generator)
    keys = torch.randn(2, 9, HEAD_DIM, generator=generator)
    values = torch.randn(2, 9, HEAD_DIM, generator=generator)
    mask = torch.tensor([[False] * 5, [True] * 5]).unsqueeze(1)  # keys 4..8 of [9, 4] keys
    out, lse = attend(queries, keys, values, KeyPadding(4, mask), with_lse=True)
    short, short_lse = attend(queries[1:], keys[1:, :4], values[1:, :4], with_lse=True)
    torch.testing.assert_close(out[1:], short)
    torch.testing.assert_close(lse[1:], short_lse)


def _prefixes(found: list[SharedPrefix]) -> set[tuple[tuple[int, ...], int]]:
    return {(tuple(sorted(p.members)), p.num_pages) for p in found}


def test_find_shared_prefixes_prefers_the_grouping_that_saves_most() -> None:
    a = list(range(100, 120))
    # 0..3 share 10 pages; 0 and 1 share 20: one group of four at 10 pages saves 30 page reads,
    # a pair at 20 saves 20.
    tables = [[*a, 1], [*a, 2], a[:10] + [3] * 10, a[:10] + [4] * 10, [7, 8, 9]]
    found = find_shared_prefixes(tables, [len(t) for t in tables], min_pages=2)
    assert _prefixes(found) == {((0, 1, 2, 3), 10)}
    # With only 2 pages in common with the others, the long pair wins.
    tables[2:4] = [a[:2] + [3] * 18, a[:2] + [4] * 18]
    found = find_shared_prefixes(tables, [len(t) for t in tables], min_pages=2)
    assert _prefixes(found) == {((0, 1), 20)}


def test_find_shared_prefixes_respects_its_limits() -> None:
    tables = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 9], [8, 2, 3]]
    # Three sharing 2 pages save as much as two sharing 4: the larger group wins the tie.
    assert _prefixes(find_shared_prefixes(tables, [5, 5, 3, 3], min_pages=2)) == {((0, 1, 2), 2)}
    assert _prefixes(find_shared_prefixes(tables, [5, 5, 3, 3], min_pages=3)) == {((0, 1), 4)}
    # Only shareable pages count: here sequence 1's fourth page holds its newest token.
    assert _prefixes(find_shared_prefixes(tables, [5, 3, 3, 3], min_pages=3)) == {((0, 1), 3)}
    assert find_shared_prefixes(tables, [5, 5, 3, 3], min_pages=5) == []
    assert find_shared_prefixes(tables, [5, 5, 3, 3], min_pages=1, min_saved_pages=5) == []
    assert find_shared_prefixes([], [], min_pages=1) == []
    assert find_shared_prefixes([[1, 2], [3, 4], [5]], [2, 2, 1], min_pages=0) == []


# ------------------------------------------------------------------ through the engine


def test_greedy_outputs_equal_with_the_prefix_cache_on_and_off(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    cascade_attention = torch_sdpa.cascade_attention

    def counting(*args, **kwargs) -> None:
        calls.append(1)
        cascade_attention(*args, **kwargs)

    monkeypatch.setattr(torch_sdpa, "cascade_attention", counting)
    model_dir = tiny_checkpoint("qwen3")
    kwargs = dict(
        dtype="float32", attention_backend="torch_sdpa", block_size=8, max_num_batched_tokens=256
    )
    on = LLM(str(model_dir), enable_prefix_caching=True, **kwargs)
    off = LLM(str(model_dir), enable_prefix_caching=False, **kwargs)
    for llm in (on, off):
        backend = llm.engine.attention
        assert isinstance(backend, TorchSdpaBackend)
        backend.cascade = ALWAYS  # the runner builds every step's metadata with this backend
    prompts = shared_prefix_prompts(on.loaded.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on.generate(prompts[:1], params, use_tqdm=False)  # the shared prompt's pages get cached
    cached = on.generate(prompts, params, use_tqdm=False)
    assert calls, "no step ran a cascade"
    calls.clear()
    plain = off.generate(prompts, params, use_tqdm=False)
    assert not calls
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
