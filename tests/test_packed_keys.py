"""Keys kept packed in the paged KV cache (vacpack/cpu_kernels/packed_keys.py): the bf16 kernels
read them in place and compute bit for bit what they compute from token rows; the cache writes
and reads them as it does token rows; an engine whose attention reads packed keys keeps its
cache packed and generates what it generates from token rows; every reader of token rows refuses
packed keys with a message that says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from asan_build import worst_difference_under_asan
from bf16_kernel_marks import ON_AVX512_BF16, TILE_KERNELS
from test_cpu_kernels import ScatteredPages

from vacpack import LLM, SamplingParams
from vacpack.attention import BatchLayout, create_backend
from vacpack.attention.cascade import CascadePolicy
from vacpack.attention.cpu_kernel_backend import CpuKernelBackend
from vacpack.attention.step_routed import StepRoutedBackend
from vacpack.attention.timed_steps import AttentionShapes, DecodeBatchShape, _inputs
from vacpack.cpu_kernels import packed_keys
from vacpack.cpu_kernels.attention import paged_attention, paged_attention_with_lse
from vacpack.cpu_kernels.packed_keys import pack_keys, packed_key_shape, unpack_keys
from vacpack.kvcache.paged_cache import KVLayer, PagedKVCache

CPU = torch.device("cpu")
BF16 = torch.bfloat16
BF16_KERNELS = [
    pytest.param("avx512_bf16", marks=ON_AVX512_BF16, id="avx512-bf16"),
    *TILE_KERNELS,
]


def test_packing_puts_pairs_of_dims_of_sixteen_keys_side_by_side() -> None:
    page_size, heads, head_dim = 32, 3, 8
    slots = torch.arange(2 * page_size * heads * head_dim).reshape(-1, heads, head_dim)
    packed = pack_keys(slots, page_size)
    assert packed.shape == (2, heads, 2, head_dim // 2, 16, 2)
    # Page 1, head 2, block 1, pair 3, key 5 of the block: slot 32 + 16 + 5, dims 6 and 7.
    assert packed[1, 2, 1, 3, 5].tolist() == slots[32 + 16 + 5, 2, 6:8].tolist()
    assert torch.equal(unpack_keys(packed), slots)


def test_packing_needs_whole_blocks_and_even_heads() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        packed_key_shape(4, 8, 2, 64)
    with pytest.raises(ValueError, match="even head size"):
        packed_key_shape(4, 16, 2, 63)
    with pytest.raises(ValueError, match="not whole pages"):
        pack_keys(torch.zeros(40, 2, 64), 16)


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "indexing"])
def test_a_packed_cache_stores_and_reads_keys_as_token_rows_do(
    in_c: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not in_c:
        monkeypatch.setattr(packed_keys, "_store_kernel", lambda: None)
    rows = PagedKVCache(2, 6, 32, 3, 64, BF16, CPU)
    packed = PagedKVCache(2, 6, 32, 3, 64, BF16, CPU, packed_keys=True)
    assert packed.keys.shape == (2, 7, 3, 2, 32, 16, 2)
    assert packed.num_bytes == rows.num_bytes
    generator = torch.Generator().manual_seed(0)
    slots = torch.tensor([3, 40, 100, 17, 63, 191, 0])
    keys = torch.randn(7, 3, 64, generator=generator)  # float32: rounded as it is stored
    values = torch.randn(7, 3, 64, generator=generator)
    for cache in (rows, packed):
        cache.layer(1).write(slots, keys, values)
    assert torch.equal(unpack_keys(packed.keys[1]), rows.keys[1])
    assert not packed.keys[0].any()
    for got, expected in zip(
        packed.layer(1).read(slots, torch.float32),
        rows.layer(1).read(slots, torch.float32),
        strict=True,
    ):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("bf16_kernel", BF16_KERNELS)
@pytest.mark.parametrize("page_size", [16, 48], ids=["page16", "page48"])
def test_the_bf16_kernels_read_packed_keys_as_they_read_token_rows(
    bf16_kernel: str, page_size: int
) -> None:
    """Decodes, a fresh prefill and a prefill chunk over cached pages scattered through the
    cache, with each row's log-sum-exp: the same bits from either layout."""
    step = ScatteredPages.random(page_size, BF16)
    q, key_cache, value_cache, cu_q, context_lens, page_table, _ = step.arguments()
    expected = paged_attention_with_lse(*step.arguments(), bf16_kernel=bf16_kernel)
    got = paged_attention_with_lse(
        q, pack_keys(key_cache, page_size), value_cache, cu_q, context_lens, page_table,
        page_size, bf16_kernel=bf16_kernel, keys_packed=True,
    )  # fmt: skip
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0].float(), step.expected(), atol=0.02, rtol=0)


@pytest.mark.parametrize("bf16_kernel", BF16_KERNELS)
def test_stale_keys_past_a_sequences_end_change_nothing(bf16_kernel: str) -> None:
    """A page's slots past its sequence's keys hold whatever was there (another sequence's
    keys, or NaN here): packed keys are read a whole block at a time, and those scores must be
    masked, not merely small."""
    step = ScatteredPages.random(16, BF16)
    q, key_cache, value_cache, cu_q, context_lens, page_table, page_size = step.arguments()
    owned = torch.cat(step.slots)
    stale = torch.ones(key_cache.shape[0], dtype=torch.bool)
    stale[owned] = False
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    key_cache[stale] = value_cache[stale] = float("nan")
    out = paged_attention(
        q, pack_keys(key_cache, page_size), value_cache, cu_q, context_lens, page_table,
        page_size, bf16_kernel=bf16_kernel, keys_packed=True,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), step.expected(), atol=0.02, rtol=0)


@pytest.mark.parametrize("bf16_kernel", BF16_KERNELS)
def test_a_cascade_reads_its_shared_prefix_from_packed_keys(bf16_kernel: str) -> None:
    """Decodes sharing three prefix pages, as a cascade (the prefix in one call for all, their
    own pages in another): the same bits from a packed cache as from token rows."""
    generator = torch.Generator().manual_seed(3)
    caches = [
        PagedKVCache(1, 20, 16, 2, 64, BF16, CPU, packed_keys=packed) for packed in (False, True)
    ]
    every_slot = torch.arange(20 * 16)
    keys, values = (torch.randn(20 * 16, 2, 64, generator=generator) for _ in "kv")
    for cache in caches:
        cache.layer(0).write(every_slot, keys, values)
    own = [5, 17, 30, 1]
    tables = [[0, 1, 2, 3 + 2 * i, 4 + 2 * i][: 3 + -(-n // 16)] for i, n in enumerate(own)]
    layout = BatchLayout([1] * 4, [48 + n for n in own], tables, 16)
    backend = CpuKernelBackend(
        cascade=CascadePolicy(min_prefix_tokens=16, min_saved_tokens=16),
        bf16_kernel=bf16_kernel,
    )
    metadata = backend.build_metadata(layout, CPU)
    assert metadata.cascade is not None
    q = torch.randn(4, 8, 64, generator=generator).to(BF16)
    k, v = (torch.randn(4, 2, 64, generator=generator).to(BF16) for _ in "kv")
    rows, packed = (backend.forward(q, k, v, cache.layer(0), metadata) for cache in caches)
    assert torch.equal(packed, rows)


def test_packed_keys_are_refused_where_no_kernel_reads_them() -> None:
    step = ScatteredPages.random(16, BF16)
    q, key_cache, value_cache, cu_q, context_lens, page_table, page_size = step.arguments()
    packed = pack_keys(key_cache, page_size)
    with pytest.raises(ValueError, match="bf16 kernels"):
        paged_attention(
            q.float(), packed, value_cache, cu_q, context_lens, page_table, page_size,
            keys_packed=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="not those of pages of 32 slots"):
        paged_attention(
            q, packed, value_cache, cu_q, context_lens, page_table * 0, 32, keys_packed=True
        )


def test_the_cpu_kernels_backend_packs_bf16_keys_and_token_row_readers_do_not() -> None:
    cpu_kernels = CpuKernelBackend()
    torch_sdpa = create_backend("torch_sdpa")
    assert cpu_kernels.packs_keys(BF16, BF16, 16)
    assert cpu_kernels.packs_keys(BF16, BF16, 48)
    assert not cpu_kernels.packs_keys(BF16, BF16, 8)  # blocks of 16 would cross pages
    assert not cpu_kernels.packs_keys(torch.float32, BF16, 16)  # the float32 kernel's cache
    assert not torch_sdpa.packs_keys(BF16, BF16, 16)
    assert StepRoutedBackend(decode=cpu_kernels, prefill=CpuKernelBackend()).packs_keys(
        BF16, BF16, 16
    )
    # One cache for both: a reader of token rows on either side keeps it in token rows.
    assert not StepRoutedBackend(decode=cpu_kernels, prefill=torch_sdpa).packs_keys(BF16, BF16, 16)


@pytest.mark.parametrize("decode_form", ["matmuls", "sdpa"])
def test_a_reader_of_token_rows_refuses_a_packed_cache(decode_form: str) -> None:
    backend = create_backend("torch_sdpa", decode_form=decode_form, cascade=None)
    cache = PagedKVCache(1, 4, 16, 2, 64, BF16, CPU, packed_keys=True)
    layout = BatchLayout([1], [5], [[2]], 16)
    q, k = torch.zeros(1, 4, 64, dtype=BF16), torch.zeros(1, 2, 64, dtype=BF16)
    metadata = backend.build_metadata(layout, CPU)
    with pytest.raises(ValueError, match="keeps its keys packed"):
        backend.forward(q, k, k, cache.layer(0), metadata)


def test_timed_candidates_read_the_cache_in_the_layout_the_engine_gives_them() -> None:
    shapes = AttentionShapes(num_heads=4, num_kv_heads=2, head_dim=64, dtype=BF16)
    inputs = _inputs(shapes, DecodeBatchShape(3, 100, 16), CPU)
    assert inputs.kv_layer is not None and not inputs.kv_layer.packed_keys
    assert inputs.kv_layer_for(create_backend("torch_sdpa")) is inputs.kv_layer
    packed = inputs.kv_layer_for(CpuKernelBackend())
    assert isinstance(packed, KVLayer) and packed.packed_keys
    assert torch.equal(unpack_keys(packed.keys), inputs.kv_layer.keys)
    assert inputs.kv_layer_for(CpuKernelBackend(bf16_kernel="emulated_tiles")) is packed


@ON_AVX512_BF16
def test_an_engine_keeps_its_keys_packed_and_generates_what_token_rows_generate(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared prompt (prefix-cache hits: prefill chunks over pages another request wrote),
    chunked prefills and decodes over pages of 16, bf16 on the C kernels: the same tokens and
    log-probabilities from either layout (the cascade's own test is the backend's, above)."""
    model_dir = tiny_checkpoint("qwen2", head_dim=32)
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 2000, (70,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (3, 9)]
    prompts += [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in (40, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def generate() -> tuple[bool, list[tuple[list[int], list[float]]]]:
        llm = LLM(
            str(model_dir), dtype="bfloat16", device="cpu", attention_backend="cpu_kernels",
            block_size=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
            enable_prefix_caching=True, kv_cache_memory_bytes=1 << 22,
        )  # fmt: skip
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        results = [
            (
                o.token_ids,
                [step[t].logprob for step, t in zip(o.logprobs, o.token_ids, strict=True)],
            )
            for o in outputs
        ]
        assert llm.engine.setup.kv_cache_keys == (
            "packed" if llm.engine.kv_cache.packed_keys else "token rows"
        )
        return llm.engine.kv_cache.packed_keys, results

    packed, from_packed = generate()
    assert packed
    monkeypatch.setattr(CpuKernelBackend, "packs_keys", lambda self, *args: False)
    packed, from_rows = generate()
    assert not packed
    assert from_packed == from_rows


ASAN_SCRIPT = """
import ctypes, sys
import torch
from vacpack.cpu_kernels import attention
from vacpack.cpu_kernels.packed_keys import pack_keys
from test_cpu_kernels import _cu, _random, _reference

function, bf16_kernel = sys.argv[2], sys.argv[3]
kernel = getattr(ctypes.CDLL(sys.argv[1]), function)
kernel.argtypes, kernel.restype = attention._ARGTYPES, ctypes.c_int
attention._kernel = lambda dtype, name="avx512_bf16": kernel
torch.set_num_threads(2)
worst = 0.0
for page_size in (16, 48):
    generator = torch.Generator().manual_seed(page_size)
    # The last sequence has the most pages, its table's row is the tensor's last, and its
    # keys end in an odd block of 16 on its last page: a kernel reading blocks in pairs past
    # its keys would read past the table.
    query_lens, context_lens = [1, 1, 20, 1], [17, 5, 60, {16: 75, 48: 140}[page_size]]
    tables, next_page = [], 0
    for n in context_lens:
        pages = -(-n // page_size)
        tables.append(list(range(next_page, next_page + pages)))
        next_page += pages
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
    for row, pages in enumerate(tables):
        table[row, : len(pages)] = torch.tensor(pages)
    keys = _random(next_page * page_size, 2, 64, generator)
    values = _random(next_page * page_size, 2, 64, generator)
    q = _random(sum(query_lens), 4, 64, generator)
    out = attention.paged_attention(
        q, pack_keys(keys, page_size), values, _cu(query_lens), torch.tensor(context_lens),
        table, page_size, bf16_kernel=bf16_kernel, keys_packed=True,
    )
    slots = torch.cat([
        (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        for pages, n in zip(tables, context_lens)
    ])
    expected = _reference(q, keys[slots], values[slots], query_lens, context_lens, True)
    worst = max(worst, float((out.float() - expected).abs().max()))
print("worst difference", worst)
"""


@pytest.mark.parametrize(
    ("source", "function", "bf16_kernel", "define"),
    [
        pytest.param(
            "varlen_attention", "varlen_attention_bf16", "avx512_bf16", "VACPACK_ASAN",
            marks=ON_AVX512_BF16, id="avx512-bf16",
        ),
        pytest.param(
            "varlen_attention_amx", "varlen_attention_amx", "avx512_bf16",
            "VACPACK_EMULATE_TILES", id="emulated-tiles",
        ),
    ],
)  # fmt: skip
def test_packed_keys_are_read_inside_their_pages(
    tmp_path: Path, source: str, function: str, bf16_kernel: str, define: str
) -> None:
    """Each kernel built with AddressSanitizer reads packed keys up to each sequence's last
    block and no further, on every table row including the tensor's last."""
    worst = worst_difference_under_asan(
        tmp_path, source, define, ASAN_SCRIPT, [function, bf16_kernel]
    )
    assert worst < 0.02
