"""BackgroundBins (packing ahead in a thread) and PinnedStager (bins onto the device)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from vacpack.corpus import (
    BackgroundBins,
    Document,
    FirstFitDecreasingPacker,
    PackedBin,
)
from vacpack.pinned_staging import PinnedStager


def numbers(count: int, delay_s: float = 0.0) -> Iterator[int]:
    for number in range(count):
        if delay_s:
            time.sleep(delay_s)
        yield number


def test_items_come_out_in_production_order() -> None:
    with BackgroundBins(numbers(500), max_ready_bins=3) as background:
        assert list(background) == list(range(500))


def test_packed_bins_come_out_in_the_packers_order() -> None:
    rng = np.random.default_rng(0)
    documents = [Document(i, np.ones(n, np.int64)) for i, n in enumerate(rng.integers(1, 90, 300))]
    packer = FirstFitDecreasingPacker(budget_tokens=128, window_docs=40)
    expected = [b.doc_indices for b in packer.pack(documents) if isinstance(b, PackedBin)]
    with BackgroundBins(packer.pack(documents), max_ready_bins=2) as background:
        received = [b.doc_indices for b in background if isinstance(b, PackedBin)]
    assert received == expected


def test_a_producer_exception_is_raised_in_the_consumer() -> None:
    def failing() -> Iterator[int]:
        yield 1
        yield 2
        raise KeyError("tokenizer broke on document 3")

    received: list[int] = []
    background = BackgroundBins(failing())
    with pytest.raises(KeyError, match="tokenizer broke"), background:
        for item in background:
            received.append(item)
    assert received == [1, 2]
    assert not background.is_alive


def test_early_close_stops_a_producer_blocked_on_a_full_queue() -> None:
    produced = 0

    def endless() -> Iterator[int]:
        nonlocal produced
        while True:
            produced += 1
            yield produced

    with BackgroundBins(endless(), max_ready_bins=2) as background:
        first = [item for _, item in zip(range(3), background, strict=False)]
    assert first == [1, 2, 3]
    assert not background.is_alive
    # Bounded: what was consumed, what the queue held, and the one item being put.
    assert produced <= 3 + 2 + 1
    assert list(background) == []  # iterating a closed pipeline ends at once


def test_breaking_out_of_the_loop_stops_the_producer_without_a_with_block() -> None:
    background = BackgroundBins(numbers(10**9))
    iterator = iter(background)
    assert next(iterator) == 0
    iterator.close()  # what happens when a consumer breaks out and the generator is collected
    assert not background.is_alive


def test_close_is_prompt_while_the_producer_is_working() -> None:
    background = BackgroundBins(numbers(10**9, delay_s=0.01), max_ready_bins=1)
    time.sleep(0.05)
    started_s = time.perf_counter()
    background.close()
    background.close()  # idempotent
    assert time.perf_counter() - started_s < 1.0
    assert not background.is_alive


def test_wait_time_shows_whether_the_producer_kept_up() -> None:
    with BackgroundBins(numbers(10, delay_s=0.02)) as slow_producer:
        assert len(list(slow_producer)) == 10
    assert slow_producer.wait_s >= 0.1  # ten items of 20 ms each, nothing ready ahead

    with BackgroundBins(numbers(10), max_ready_bins=10) as fast_producer:
        time.sleep(0.1)  # the queue fills while the "device" is busy
        assert len(list(fast_producer)) == 10
    assert fast_producer.wait_s < 0.05


def test_no_thread_is_left_behind() -> None:
    before = threading.active_count()
    for _ in range(5):
        with BackgroundBins(numbers(100)) as background:
            next(iter(background))
    assert threading.active_count() == before


def test_rejects_an_empty_queue() -> None:
    with pytest.raises(ValueError, match="max_ready_bins"):
        BackgroundBins(numbers(1), max_ready_bins=0)


# ------------------------------------------------------------------ staging


def packed_bins(budget_tokens: int) -> list[PackedBin]:
    rng = np.random.default_rng(1)
    lengths = [*rng.integers(1, budget_tokens // 2, 60).tolist(), 3 * budget_tokens]
    documents = [Document(i, rng.integers(0, 30000, n)) for i, n in enumerate(lengths)]
    packer = FirstFitDecreasingPacker(budget_tokens, window_docs=16, align_to=8)
    return [b for b in packer.pack(documents) if isinstance(b, PackedBin)]


def test_on_cpu_staging_returns_the_bins_own_tensors() -> None:
    stager = PinnedStager(torch.device("cpu"), capacity=128, copy_stream=True)
    for packed in packed_bins(64):
        token_ids, positions = stager.stage([packed.token_ids, packed.positions])
        assert token_ids is packed.token_ids
        assert positions is packed.positions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_staged_values_match_while_copies_overlap_compute() -> None:
    device = torch.device("cuda")
    budget_tokens = 4096
    bins = packed_bins(budget_tokens)
    assert any(b.oversize for b in bins)  # bigger than the pinned buffers: they grow
    stager = PinnedStager(device, 2 * budget_tokens, copy_stream=True)
    busy = torch.randn(2048, 2048, device=device)
    received = []
    for packed in bins:
        token_ids, positions = stager.stage([packed.token_ids, packed.positions])
        # Queue device work that reads the bin without any host sync, as a forward would, while
        # the next bin is written into the other pinned buffer and copied.
        busy = torch.tanh(busy @ busy)
        received.append((token_ids * 1, positions * 1))
    torch.cuda.synchronize(device)
    assert token_ids.device.type == "cuda"
    for packed, (token_ids, positions) in zip(bins, received, strict=True):
        assert torch.equal(token_ids.cpu(), packed.token_ids)
        assert torch.equal(positions.cpu(), packed.positions)
