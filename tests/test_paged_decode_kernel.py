"""The portable paged-decode C kernel against a float64 reference, in both its forms (grouped
query heads apart and in vector lanes): every sequence attends to its visible keys, read from
shuffled pages, in float32 and bf16, for grouped-query and multi-head shapes, groups of more
than eight heads, past a sliding window's start, and split over threads when few sequences
are long (split-K)."""

from __future__ import annotations

import pytest
import torch

from vacpack.cpu_kernels.paged_decode import paged_decode_attention, paged_decode_supported

CPU = torch.device("cpu")
PAGE_SIZE = 16
# (query heads, KV heads, head_dim)
SHAPES = [
    pytest.param((14, 2, 64), id="gqa7-d64"),
    pytest.param((12, 12, 32), id="mha-d32"),
    pytest.param((8, 1, 128), id="mqa-d128"),
    pytest.param((24, 2, 48), id="gqa12-d48"),  # two groups of lanes, one half idle
    pytest.param((16, 1, 256), id="mqa16-d256"),
]
FORMS = [pytest.param(False, id="heads-apart"), pytest.param(True, id="heads-in-lanes")]

pytestmark = pytest.mark.skipif(
    not paged_decode_supported(CPU, torch.float32, 2, 1, 64),
    reason="the paged decode C kernel does not build here (no C compiler)",
)


def _case(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    key_ranges: list[tuple[int, int]],
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    num_heads, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = max(-(-n // PAGE_SIZE) for _, n in key_ranges)
    num_pages = pages_per_seq * len(key_ranges) + 3
    order = torch.randperm(num_pages, generator=generator)
    pages = torch.zeros(len(key_ranges), pages_per_seq, dtype=torch.int64)  # padding: page 0
    used = 0
    for index, (_, num_keys) in enumerate(key_ranges):
        count = -(-num_keys // PAGE_SIZE)
        pages[index, :count] = order[used : used + count]
        used += count
    cache_shape = (num_pages * PAGE_SIZE, num_kv_heads, head_dim)
    keys = torch.randn(cache_shape, generator=generator).to(dtype)
    values = torch.randn(cache_shape, generator=generator).to(dtype)
    q = torch.randn(len(key_ranges), num_heads, head_dim, generator=generator).to(dtype)
    return q, keys, values, pages, torch.tensor(key_ranges, dtype=torch.int64)


def _reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pages: torch.Tensor,
    key_ranges: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's output and the log-sum-exp of its scaled scores, in float64."""
    num_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty(q.shape[:2], dtype=torch.float64)
    for seq, (first, num_keys) in enumerate(key_ranges.tolist()):
        positions = torch.arange(first, num_keys)
        slots = pages[seq, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        k, v = keys[slots].double(), values[slots].double()
        for head in range(num_heads):
            scores = k[:, head // group] @ q[seq, head].double() * scale
            out[seq, head] = torch.softmax(scores, dim=0) @ v[:, head // group]
            lse[seq, head] = torch.logsumexp(scores, dim=0)
    return out, lse


@pytest.mark.parametrize("heads_in_lanes", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equals_reference(
    shape: tuple[int, int, int], dtype: torch.dtype, heads_in_lanes: bool
) -> None:
    """One key, a page and one, many pages, a window's start inside a page, and a long
    sequence; scale not head_dim ** -0.5."""
    key_ranges = [(0, 1), (0, 17), (3, 40), (100, 300), (0, 1500)]
    q, keys, values, pages, ranges = _case(shape, dtype, key_ranges)
    got, lse = paged_decode_attention(
        q, keys, values, pages, ranges, PAGE_SIZE, 0.2, with_lse=True, heads_in_lanes=heads_in_lanes
    )
    assert got.dtype == dtype and got.shape == q.shape
    assert lse is not None and lse.dtype == torch.float32
    expected, expected_lse = _reference(q, keys, values, pages, ranges, scale=0.2)
    # bf16: the output's own rounding (8 bits) dominates.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)
    without, no_lse = paged_decode_attention(
        q, keys, values, pages, ranges, PAGE_SIZE, 0.2, heads_in_lanes=heads_in_lanes
    )
    assert no_lse is None and torch.equal(without, got)


@pytest.mark.parametrize("heads_in_lanes", FORMS)
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_split_keys_merge_to_the_same_result(threads: int, heads_in_lanes: bool) -> None:
    """One long sequence behind a window's start: with more threads its visible keys are split
    over tasks and merged by their log-sum-exp."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, keys, values, pages, ranges = _case((4, 2, 64), torch.float32, [(700, 3000), (0, 9)])
        got, lse = paged_decode_attention(
            q, keys, values, pages, ranges, PAGE_SIZE, 0.125, True, heads_in_lanes
        )
    finally:
        torch.set_num_threads(previous)
    expected, expected_lse = _reference(q, keys, values, pages, ranges, scale=0.125)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert lse is not None
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


def test_rejects_a_cache_it_cannot_read() -> None:
    """Keys and values in different dtypes, and bfloat16 queries over a float32 cache (a bf16
    cache under float32 queries is read: test_bf16_kv_cache.py)."""
    q, keys, values, pages, ranges = _case((4, 2, 32), torch.float32, [(0, 5)])
    with pytest.raises(ValueError, match="KV cache"):
        paged_decode_attention(q, keys.bfloat16(), values, pages, ranges, PAGE_SIZE, 0.1)
    with pytest.raises(ValueError, match="bfloat16 under float32"):
        paged_decode_attention(q.bfloat16(), keys, values, pages, ranges, PAGE_SIZE, 0.1)


def test_rejects_tables_and_rows_it_would_misread() -> None:
    """The kernel reads the page table and key ranges as int64 and the cache's rows at
    head_dim's stride: another dtype or shape is refused before it reads anything."""
    q, keys, values, pages, ranges = _case((4, 2, 32), torch.float32, [(0, 5), (1, 9)])
    args = (PAGE_SIZE, 0.1)
    with pytest.raises(ValueError, match="pages must be int64"):
        paged_decode_attention(q, keys, values, pages.int(), ranges, *args)
    with pytest.raises(ValueError, match="key_ranges must be int64"):
        paged_decode_attention(q, keys, values, pages, ranges.int(), *args)
    with pytest.raises(ValueError, match="key_ranges must be"):
        paged_decode_attention(q, keys, values, pages, ranges[:, :1], *args)
    with pytest.raises(ValueError, match="pages must be int64"):
        paged_decode_attention(q, keys, values, pages[:1], ranges, *args)
    with pytest.raises(ValueError, match="keys and values must both be"):
        paged_decode_attention(q, keys[..., :16], values[..., :16], pages, ranges, *args)
    with pytest.raises(ValueError, match="keys and values must both be"):
        paged_decode_attention(q, keys, values[:-1], pages, ranges, *args)


def test_shapes_past_its_buffers_are_not_supported() -> None:
    assert not paged_decode_supported(CPU, torch.float32, 32, 1, 64)  # 32 heads per KV head
    assert not paged_decode_supported(CPU, torch.float32, 4, 2, 512)  # head_dim 512
    assert not paged_decode_supported(CPU, torch.float32, 4, 2, 20)  # not a multiple of 8
    assert not paged_decode_supported(CPU, torch.float16, 4, 2, 64)
