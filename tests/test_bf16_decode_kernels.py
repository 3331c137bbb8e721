"""The bf16-only decode kernels against a float64 reference: paged_decode_bf16.c (VDPBF16PS,
heads in lanes) and paged_decode_amx.c (AMX tiles), on the real instructions where the CPU has
them and everywhere with those instructions emulated in plain C. Keys read in place or (AMX)
copied where a tile's keys lie on two pages or past its range, windows starting inside a page,
split-K, group sizes from 1 to 16 (two lane groups), head sizes 32 to 256 (the AMX kernel's
last value pass of two tiles), odd key counts (a last key pair of one); their self-checks; the
engine's decode forms that run them; and builds with AddressSanitizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from asan_build import worst_difference_under_asan
from bf16_kernel_marks import BF16_DECODE_KERNELS, EMULATED
from test_paged_decode_kernel import _case, _reference

from vacpack import LLM, SamplingParams
from vacpack.attention import BatchLayout
from vacpack.attention import paged_decode as decode_forms
from vacpack.attention.backend import FULL_ATTENTION
from vacpack.attention.cascade import CascadePolicy
from vacpack.attention.torch_sdpa import TorchSdpaBackend
from vacpack.cpu_kernels import paged_decode as kernel_module
from vacpack.cpu_kernels.paged_decode import (
    bf16_decode_ready,
    paged_decode_attention,
    paged_decode_supported,
)
from vacpack.kvcache.paged_cache import PagedKVCache
from vacpack.tuning.choose import force_env_var

CPU = torch.device("cpu")
PAGE_SIZE = 16  # test_paged_decode_kernel's pages
ATOL = 1e-2  # bf16 output and probabilities rounded to bf16 (the portable kernel's bf16 bound)
# (query heads, KV heads, head_dim)
SHAPES = [
    pytest.param((14, 2, 64), id="gqa7-d64"),
    pytest.param((4, 4, 32), id="mha-d32"),  # one head per KV head: idle lanes and columns
    pytest.param((24, 2, 64), id="gqa12-d64"),  # VDPBF16PS: two lane groups, the second half idle
    pytest.param((16, 1, 128), id="mqa16-d128"),  # a full tile of heads; two full lane groups
    pytest.param((6, 2, 96), id="gqa3-d96"),  # AMX: a value pass of four tiles, then one of two
    pytest.param((8, 1, 256), id="mqa8-d256"),
]
# (first visible key, number of keys): one key; a tile and one; a window's start inside a page
# (a copied first tile) and a copied last tile; block edges; many blocks.
KEY_RANGES = [(0, 1), (0, 17), (3, 40), (0, 64), (50, 129), (100, 300), (0, 1500)]


@pytest.mark.parametrize("bf16_kernel", BF16_DECODE_KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_reference(shape: tuple[int, int, int], bf16_kernel: str) -> None:
    q, keys, values, pages, ranges = _case(shape, torch.bfloat16, KEY_RANGES, seed=shape[2])
    got, lse = paged_decode_attention(
        q, keys, values, pages, ranges, PAGE_SIZE, 0.2, with_lse=True, bf16_kernel=bf16_kernel
    )
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    expected, expected_lse = _reference(q, keys, values, pages, ranges, scale=0.2)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=ATOL)
    assert lse is not None
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)
    without, no_lse = paged_decode_attention(
        q, keys, values, pages, ranges, PAGE_SIZE, 0.2, bf16_kernel=bf16_kernel
    )
    assert no_lse is None and torch.equal(without, got)


@pytest.mark.parametrize("bf16_kernel", BF16_DECODE_KERNELS)
@pytest.mark.parametrize("page_size", [8, 48])
def test_pages_of_other_sizes(page_size: int, bf16_kernel: str) -> None:
    """8-token pages put every tile's keys on two pages (all copied); 48-token pages put a
    tile on each page's edge in place (16 divides 48)."""
    generator = torch.Generator().manual_seed(page_size)
    key_ranges = torch.tensor([[0, 7], [5, 100], [0, 333]], dtype=torch.int64)
    pages_per_seq = -(-333 // page_size)
    pages = torch.randperm(3 * pages_per_seq, generator=generator).view(3, pages_per_seq)
    cache_shape = (3 * pages_per_seq * page_size, 2, 64)
    keys, values = (torch.randn(cache_shape, generator=generator).bfloat16() for _ in "kv")
    q = torch.randn(3, 14, 64, generator=generator).bfloat16()
    got, lse = paged_decode_attention(
        q, keys, values, pages, key_ranges, page_size, 0.125, with_lse=True, bf16_kernel=bf16_kernel
    )
    # The same attention over the same keys, on 16-token pages: the reference's.
    slots = []
    for seq, num_keys in enumerate(key_ranges[:, 1].tolist()):
        positions = torch.arange(num_keys)
        slots.append(pages[seq, positions // page_size] * page_size + positions % page_size)
    per_seq = -(-333 // PAGE_SIZE) * PAGE_SIZE
    flat_keys = torch.zeros(3 * per_seq, 2, 64, dtype=torch.bfloat16)
    flat_values = torch.zeros_like(flat_keys)
    for seq, seq_slots in enumerate(slots):
        flat_keys[seq * per_seq : seq * per_seq + len(seq_slots)] = keys[seq_slots]
        flat_values[seq * per_seq : seq * per_seq + len(seq_slots)] = values[seq_slots]
    flat_pages = torch.arange(3 * per_seq // PAGE_SIZE).view(3, -1)
    expected, expected_lse = _reference(
        q, flat_keys, flat_values, flat_pages, key_ranges, scale=0.125
    )
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=ATOL)
    assert lse is not None
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bf16_kernel", BF16_DECODE_KERNELS)
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_split_keys_merge_to_the_same_result(threads: int, bf16_kernel: str) -> None:
    """Few long sequences: their keys split over tasks whose ranges start inside tiles (copied
    first tiles), merged by log-sum-exp."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, keys, values, pages, ranges = _case(
            (14, 2, 64), torch.bfloat16, [(701, 3000), (0, 9)], seed=threads
        )
        got, lse = paged_decode_attention(
            q, keys, values, pages, ranges, PAGE_SIZE, 0.125, True, bf16_kernel=bf16_kernel
        )
    finally:
        torch.set_num_threads(previous)
    expected, expected_lse = _reference(q, keys, values, pages, ranges, scale=0.125)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=ATOL)
    assert lse is not None
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


@EMULATED
def test_what_the_kernels_take() -> None:
    """bf16 queries and cache only (both instructions multiply bf16), head_dim a multiple of 16
    (VDPBF16PS's value rows are interleaved 16 dims at a time) or 32 (a tile row of bf16), at
    most 16 heads per KV head; an unknown name is refused."""
    for name, multiple in (("emulated_dpbf16", 16), ("emulated_tiles", 32)):
        assert paged_decode_supported(CPU, torch.bfloat16, 14, 2, 64, bf16_kernel=name)
        assert not paged_decode_supported(CPU, torch.float32, 14, 2, 64, bf16_kernel=name)
        runs_48 = paged_decode_supported(CPU, torch.bfloat16, 14, 2, 48, bf16_kernel=name)
        assert runs_48 == (48 % multiple == 0)
        assert not paged_decode_supported(CPU, torch.bfloat16, 14, 2, 40, bf16_kernel=name)
        assert not paged_decode_supported(CPU, torch.bfloat16, 32, 1, 64, bf16_kernel=name)
    with pytest.raises(ValueError, match="bf16_kernel must be one of"):
        paged_decode_supported(CPU, torch.bfloat16, 14, 2, 64, bf16_kernel="avx9000")


@EMULATED
@pytest.mark.parametrize("bf16_kernel", ["emulated_dpbf16", "emulated_tiles"])
def test_a_kernel_that_fails_its_self_check_is_not_used(
    monkeypatch, caplog, bf16_kernel: str
) -> None:
    """Written where no CPU with its instructions was at hand, each kernel proves itself where
    it runs: one that computes something else than attention is turned off, with a warning."""
    kernel_module._bf16_kernel.cache_clear()
    monkeypatch.setattr(kernel_module, "SELF_CHECK_TOLERANCE", -1.0)  # nothing passes
    try:
        assert not bf16_decode_ready(bf16_kernel)
        assert not paged_decode_supported(CPU, torch.bfloat16, 14, 2, 64, bf16_kernel=bf16_kernel)
        assert "self-check differs from float32 attention" in caplog.text
    finally:
        kernel_module._bf16_kernel.cache_clear()
    monkeypatch.undo()
    assert bf16_decode_ready(bf16_kernel)


def _decode_step(backend: TorchSdpaBackend, num_shared_pages: int) -> torch.Tensor:
    """A step of four bf16 decodes (14 query heads on 2 KV heads of 64 dims) over shuffled
    16-token pages, the first num_shared_pages of every table the same (a cached prefix),
    through `backend`."""
    generator = torch.Generator().manual_seed(num_shared_pages)
    context_lens = (13, 40, 77, 150)
    own_pages = [-(-n // PAGE_SIZE) - num_shared_pages for n in context_lens]
    num_pages = num_shared_pages + sum(own_pages) + 1
    order = torch.randperm(num_pages, generator=generator).tolist()
    page_tables, start = [], num_shared_pages
    for count in own_pages:
        page_tables.append(order[:num_shared_pages] + order[start : start + count])
        start += count
    cache = PagedKVCache(1, num_pages, PAGE_SIZE, 2, 64, torch.bfloat16, CPU)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    q, k, v = (torch.randn(4, heads, 64, generator=generator).bfloat16() for heads in (14, 2, 2))
    layout = BatchLayout((1,) * 4, context_lens, page_tables, PAGE_SIZE)
    metadata = backend.build_metadata(layout, CPU)
    return backend.forward(q, k, v, cache.layer(0), metadata, FULL_ATTENTION)


@pytest.mark.parametrize("bf16_kernel", BF16_DECODE_KERNELS)
@pytest.mark.parametrize("num_shared_pages", [0, 2], ids=["plain", "cascade"])
def test_the_engine_decode_forms_run_the_kernels(
    monkeypatch, bf16_kernel: str, num_shared_pages: int
) -> None:
    """The portable backend's decode form of each kernel ("kernel_bf16", "kernel_amx") through
    a step of decodes (with a cascade over a shared prefix, which merges by the kernel's
    log-sum-exp) equals the same step through the matmul form within bf16 rounding."""
    form = "kernel_amx" if bf16_kernel in ("amx", "emulated_tiles") else "kernel_bf16"
    monkeypatch.setitem(
        decode_forms.KERNEL_FORMS, form, decode_forms.KernelForm(False, bf16_kernel)
    )
    policy = CascadePolicy(min_prefix_tokens=1, min_saved_tokens=1) if num_shared_pages else None
    got = _decode_step(TorchSdpaBackend(policy, decode_form=form), num_shared_pages)
    expected = _decode_step(TorchSdpaBackend(policy, decode_form="matmuls"), num_shared_pages)
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL, rtol=ATOL)


@EMULATED
@pytest.mark.parametrize(
    ("form", "bf16_kernel"),
    [("kernel_bf16", "emulated_dpbf16"), ("kernel_amx", "emulated_tiles")],
)
def test_an_engine_decodes_through_the_form_it_is_given(
    tiny_checkpoint, monkeypatch, form: str, bf16_kernel: str
) -> None:
    """A bf16 model in bf16 arithmetic, its decode form forced through the measured selection's
    environment variable: the selection offers the form where its kernel runs, and the engine
    runs every decode step of every layer through it. (Greedy tokens are not compared: in bf16 a
    tiny random model's near-ties flip between any two of the existing forms too, SDPA against
    the matmuls on half the prompts.)"""
    monkeypatch.setitem(
        decode_forms.KERNEL_FORMS, form, decode_forms.KernelForm(False, bf16_kernel)
    )
    kernels_called: list[str | None] = []
    real_kernel = decode_forms.paged_decode_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        kernels_called.append(kwargs.get("bf16_kernel"))
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(decode_forms, "paged_decode_attention", counting)
    monkeypatch.setenv(force_env_var("sdpa_decode"), form)
    model_dir = str(tiny_checkpoint("qwen3", head_dim=32))
    llm = LLM(
        model_dir, dtype="bfloat16", cpu_bf16_arithmetic="bfloat16", attention_backend="torch_sdpa"
    )
    assert isinstance(llm.engine.attention, TorchSdpaBackend)
    assert llm.engine.attention.decode_form == form
    kernels_called.clear()
    max_tokens, num_layers = 10, llm.loaded.config.num_layers
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(output.outputs[0].token_ids) == max_tokens for output in outputs)
    # A call per layer and step with decodes: at least max_tokens - 1 such steps (the first
    # token comes from the prefill), and only this kernel.
    assert set(kernels_called) == {bf16_kernel}
    assert len(kernels_called) >= num_layers * (max_tokens - 1)


ASAN_SCRIPT = """
import ctypes, sys
import torch
from vacpack.cpu_kernels import paged_decode
from test_paged_decode_kernel import _case, _reference

library, function, name = sys.argv[1:]
kernel = getattr(ctypes.CDLL(library), function)
kernel.argtypes, kernel.restype = paged_decode._BF16_ARGTYPES, ctypes.c_int
paged_decode._bf16_kernel = lambda name: kernel
torch.set_num_threads(3)
worst = paged_decode._self_check(kernel)
ranges = [(0, 1), (3, 40), (50, 129), (701, 2000)]
for shape in ((14, 2, 64), (16, 1, 128), (6, 2, 96)):
    q, keys, values, pages, key_ranges = _case(shape, torch.bfloat16, ranges)
    out, _ = paged_decode.paged_decode_attention(
        q, keys, values, pages, key_ranges, 16, 0.2, True, bf16_kernel=name
    )
    expected, _ = _reference(q, keys, values, pages, key_ranges, scale=0.2)
    worst = max(worst, float((out.double() - expected).abs().max()))
print("worst difference", worst)
"""


@pytest.mark.parametrize(
    ("source", "define", "name"),
    [
        ("paged_decode_bf16", "VACPACK_EMULATE_DPBF16", "emulated_dpbf16"),
        ("paged_decode_amx", "VACPACK_EMULATE_TILES", "emulated_tiles"),
    ],
)
def test_the_kernels_stay_inside_their_buffers(
    tmp_path: Path, source: str, define: str, name: str
) -> None:
    """Each emulated kernel built with AddressSanitizer: rows read in place from the cache's
    pages, copied tiles, packed values and outputs all stay inside their memory."""
    worst = worst_difference_under_asan(tmp_path, source, define, ASAN_SCRIPT, [source, name])
    assert worst < ATOL
