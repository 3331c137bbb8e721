"""The CPU attention kernels store an engine step's new keys and values themselves (kv_store.h),
as the first phase of the call that reads them: the cache they leave must be the one
KVLayer.write leaves, bit for bit, in either key layout and cache dtype, and the attention the
same as storing first and attending after. A slot outside the cache is refused before anything
is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from asan_build import VARLEN_BF16_PRELUDE, worst_difference_under_asan
from bf16_kernel_marks import EMULATED, ON_AVX512_BF16
from test_split_decodes import HEAD_DIM, HEADS, KV_HEADS, PAGE_SIZE, _paged_step

from vacpack.attention.backend import BatchLayout
from vacpack.attention.cpu_kernel_backend import CpuKernelBackend
from vacpack.cpu_kernels import (
    KernelSequences,
    NewKV,
    attend,
    attend_with_lse,
    packed_sequences,
)
from vacpack.cpu_kernels.packed_keys import pack_keys
from vacpack.kvcache.paged_cache import KVLayer

# Three decodes and a prefill chunk of 24 tokens over cached pages, in an engine step's order
# (decodes first): each sequence's new tokens are its last ones, and the step's attention
# reads them.
QUERY_LENS = [1, 1, 1, 24]
CONTEXT_LENS = [37, 16, 300, 90]

# (queries, cache) dtypes and kernel: bf16 on AVX-512 or on (emulated) AMX tiles, float32 over
# a float32 cache or over a bf16 one.
KERNELS = [
    pytest.param(torch.bfloat16, torch.bfloat16, "avx512_bf16", marks=ON_AVX512_BF16, id="bf16"),
    pytest.param(torch.bfloat16, torch.bfloat16, "emulated_tiles", marks=EMULATED, id="tiles"),
    pytest.param(torch.float32, torch.float32, "avx512_bf16", marks=EMULATED, id="f32"),
    pytest.param(torch.float32, torch.bfloat16, "avx512_bf16", marks=EMULATED, id="f32-bf16-kv"),
]


def _step(dtype: torch.dtype, cache_dtype: torch.dtype, keys_packed: bool) -> dict:
    """_paged_step's cache in `cache_dtype` (keys packed or not), queries in `dtype`, the new
    tokens' slots, and their keys and values as slices of a wider projection (strided rows)."""
    step = _paged_step(QUERY_LENS, CONTEXT_LENS, seed=3)
    generator = torch.Generator().manual_seed(4)
    page_tables = step["sequences"].page_tables
    slots = []
    for row, (n_q, n_k) in enumerate(zip(QUERY_LENS, CONTEXT_LENS, strict=True)):
        for position in range(n_k - n_q, n_k):
            page = int(page_tables[row, position // PAGE_SIZE])
            slots.append(page * PAGE_SIZE + position % PAGE_SIZE)
    num_new = len(slots)
    projection = torch.randn(num_new, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    new_keys, new_values = projection.to(dtype)[:, HEADS * HEAD_DIM :].split(
        KV_HEADS * HEAD_DIM, dim=1
    )
    keys = step["keys"].to(cache_dtype)
    return {
        "q": step["q"].to(dtype),
        "layer": KVLayer(
            pack_keys(keys, PAGE_SIZE) if keys_packed else keys,
            step["values"].to(cache_dtype),
            PAGE_SIZE,
            keys_packed,
        ),
        "sequences": step["sequences"],
        "new_kv": NewKV(
            torch.tensor(slots),
            new_keys.view(num_new, KV_HEADS, HEAD_DIM),
            new_values.view(num_new, KV_HEADS, HEAD_DIM),
        ),
    }


def _copy(layer: KVLayer) -> KVLayer:
    return KVLayer(layer.keys.clone(), layer.values.clone(), layer.page_size, layer.packed_keys)


@pytest.mark.parametrize("keys_packed", [False, True], ids=["token-rows", "packed-keys"])
@pytest.mark.parametrize(("dtype", "cache_dtype", "bf16_kernel"), KERNELS)
def test_the_kernel_stores_what_the_layer_would_and_attends_over_it(
    dtype: torch.dtype, cache_dtype: torch.dtype, bf16_kernel: str, keys_packed: bool
) -> None:
    if keys_packed and dtype != torch.bfloat16:
        pytest.skip("packed keys are the bf16 kernels' layout")
    step = _step(dtype, cache_dtype, keys_packed)
    new_kv, sequences = step["new_kv"], step["sequences"]
    written = _copy(step["layer"])
    written.write(new_kv.slots, new_kv.keys, new_kv.values)
    expected, expected_lse = attend_with_lse(
        step["q"], written.keys, written.values, sequences, bf16_kernel=bf16_kernel,
        keys_packed=keys_packed,
    )  # fmt: skip

    stored = _copy(step["layer"])
    out, lse = attend_with_lse(
        step["q"], stored.keys, stored.values, sequences, bf16_kernel=bf16_kernel,
        keys_packed=keys_packed, new_kv=new_kv,
    )  # fmt: skip
    assert torch.equal(stored.keys, written.keys)
    assert torch.equal(stored.values, written.values)
    assert not torch.equal(stored.values, step["layer"].values)  # the step wrote something
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)


@pytest.mark.parametrize("bad_slot", [-1, "past the end"])
@pytest.mark.parametrize("keys_packed", [False, True], ids=["token-rows", "packed-keys"])
@ON_AVX512_BF16
def test_a_slot_outside_the_cache_is_refused_before_anything_is_stored(
    keys_packed: bool, bad_slot: int | str
) -> None:
    step = _step(torch.bfloat16, torch.bfloat16, keys_packed)
    layer, new_kv = _copy(step["layer"]), step["new_kv"]
    slots = new_kv.slots.clone()
    slots[-1] = layer.values.shape[0] if bad_slot == "past the end" else bad_slot
    with pytest.raises(ValueError, match="slot lies outside the KV cache; nothing was stored"):
        attend(
            step["q"], layer.keys, layer.values, step["sequences"], keys_packed=keys_packed,
            new_kv=NewKV(slots, new_kv.keys, new_kv.values),
        )  # fmt: skip
    assert torch.equal(layer.keys, step["layer"].keys)
    assert torch.equal(layer.values, step["layer"].values)


@ON_AVX512_BF16
def test_new_keys_need_a_paged_cache_of_their_shape() -> None:
    step = _step(torch.bfloat16, torch.bfloat16, keys_packed=False)
    layer, new_kv = step["layer"], step["new_kv"]
    streams = packed_sequences(torch.tensor([0, 4]), torch.tensor([0, 4]), causal=True)
    q = step["q"][:4]
    with pytest.raises(ValueError, match="give page tables"):
        attend(q, layer.keys[:4], layer.values[:4], streams, new_kv=new_kv)
    narrow = NewKV(new_kv.slots, new_kv.keys[:, :1], new_kv.values[:, :1])
    with pytest.raises(ValueError, match="do not match a cache of 2 KV heads of 64"):
        attend(step["q"], layer.keys, layer.values, step["sequences"], new_kv=narrow)
    apart = layer.keys.transpose(0, 1).contiguous().transpose(0, 1)  # each slot's heads apart
    with pytest.raises(ValueError, match="keeps each slot's heads together"):
        attend(step["q"], apart, layer.values, step["sequences"], new_kv=new_kv)


@ON_AVX512_BF16
def test_an_engine_step_through_the_backend_stores_its_keys_and_values() -> None:
    """CpuKernelBackend.forward hands the step's keys and values to the kernel: the layer's
    cache afterwards is the one KVLayer.write leaves."""
    step = _step(torch.bfloat16, torch.bfloat16, keys_packed=True)
    backend = CpuKernelBackend()
    layer, new_kv = _copy(step["layer"]), step["new_kv"]
    sequences = step["sequences"]
    metadata = backend.build_metadata(_layout(sequences), torch.device("cpu"))
    assert torch.equal(metadata.slot_mapping, new_kv.slots)
    out = backend.forward(step["q"], new_kv.keys, new_kv.values, layer, metadata)
    written = _copy(step["layer"])
    written.write(new_kv.slots, new_kv.keys, new_kv.values)
    assert torch.equal(layer.keys, written.keys) and torch.equal(layer.values, written.values)
    expected = attend(step["q"], written.keys, written.values, sequences, keys_packed=True)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def _layout(sequences: KernelSequences) -> BatchLayout:
    """The engine's description of the batch `sequences` holds."""
    query_lens = sequences.cu_seqlens_q.diff().tolist()
    context_lens = sequences.cu_seqlens_k.diff().tolist()
    tables = [
        row[: -(-n // PAGE_SIZE)].tolist()
        for row, n in zip(sequences.page_tables, context_lens, strict=True)
    ]
    return BatchLayout(query_lens, context_lens, tables, PAGE_SIZE)


ASAN_SCRIPT = (
    VARLEN_BF16_PRELUDE
    + """
import test_kernel_kv_store as cases

worst = 0.0
for packed in (False, True):
    step = cases._step(torch.bfloat16, torch.bfloat16, packed)
    layer, new_kv = step["layer"], step["new_kv"]
    # The cache's last slot too: the store must stay inside the cache's memory.
    slots = new_kv.slots.clone()
    slots[0] = layer.values.shape[0] - 1
    stored = attention.NewKV(slots, new_kv.keys, new_kv.values)
    attention.attend(step["q"], layer.keys, layer.values, step["sequences"], keys_packed=packed,
                     new_kv=stored)
    written = cases._copy(step["layer"])
    written.write(slots, new_kv.keys, new_kv.values)
    worst = max(worst, float((layer.keys.float() - written.keys.float()).abs().max()))
    worst = max(worst, float((layer.values.float() - written.values.float()).abs().max()))
print("worst difference", worst)
"""
)


@ON_AVX512_BF16
def test_the_store_stays_inside_the_cache(tmp_path: Path) -> None:
    """The bf16 kernel built with AddressSanitizer stores into the cache's last slot in both
    key layouts: every write lands inside the cache, and where KVLayer.write puts it."""
    worst = worst_difference_under_asan(tmp_path, "varlen_attention", "VACPACK_ASAN", ASAN_SCRIPT)
    assert worst == 0.0
