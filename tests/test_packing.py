"""FirstFitDecreasingPacker: whole documents into padding-free bins, streamed in windows."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vacpack.corpus import (
    PADDING_DOC_INDEX,
    Document,
    DocumentError,
    FirstFitDecreasingPacker,
    PackedBin,
    PackerOutput,
)


def make_documents(lengths: Sequence[int]) -> list[Document]:
    # Token ids encode (document, offset) so a misplaced token is caught.
    return [Document(i, np.arange(n, dtype=np.int64) + 1000 * i) for i, n in enumerate(lengths)]


def bins_of(outputs: Sequence[PackerOutput]) -> list[PackedBin]:
    return [item for item in outputs if isinstance(item, PackedBin)]


def check_bin_layout(packed: PackedBin, packer: FirstFitDecreasingPacker) -> None:
    """Stream, positions and boundaries agree with the segments, documents are whole."""
    seq_lens = np.asarray(packed.seq_lens)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.token_ids.dtype == packed.positions.dtype == torch.int64
    assert packed.cu_seqlens.tolist() == [0, *np.cumsum(seq_lens).tolist()]
    assert packed.num_tokens == packed.token_ids.numel() == packed.positions.numel()
    assert packed.num_tokens == int(seq_lens.sum())
    assert len(packed.doc_indices) == len(packed.documents) == packed.num_segments
    expected_positions = np.concatenate([np.arange(n) for n in seq_lens])
    assert packed.positions.tolist() == expected_positions.tolist()
    num_padding_tokens = 0
    starts = packed.cu_seqlens.tolist()
    for segment, document in enumerate(packed.documents):
        tokens = packed.token_ids[starts[segment] : starts[segment + 1]].numpy()
        if document is None:
            assert packed.doc_indices[segment] == PADDING_DOC_INDEX
            assert (tokens == packer.pad_token_id).all()
            num_padding_tokens += tokens.size
        else:
            assert packed.doc_indices[segment] == document.index
            assert np.array_equal(tokens, document.token_ids)
    assert packed.num_padding_tokens == num_padding_tokens
    if not packed.oversize:
        assert packed.num_tokens <= packer.budget_tokens


def slot_tokens(num_tokens: int, align_to: int | None) -> int:
    return num_tokens if align_to is None else -(-num_tokens // align_to) * align_to


# ------------------------------------------------------------------ reference


@dataclass
class _RefBin:
    free_tokens: int
    doc_indices: list[int] = field(default_factory=list)
    carried: bool = False


def reference_outputs(
    lengths: Sequence[int],
    budget_tokens: int,
    window_docs: int,
    align_to: int | None = None,
    carry_open_bins: int = 0,
) -> list[tuple[str, tuple[int, ...]]]:
    """A plain first-fit decreasing: linear scans over lists, the same windows and carry rule."""
    outputs: list[tuple[str, tuple[int, ...]]] = []
    window: list[int] = []
    carried: list[_RefBin] = []

    def place(carry: int) -> list[_RefBin]:
        bins = list(carried)
        # Longest slot first; equal slots in input order.
        for index in sorted(window, key=lambda i: (-slot_tokens(lengths[i], align_to), i)):
            slot = slot_tokens(lengths[index], align_to)
            target = next((b for b in bins if b.free_tokens >= slot), None)
            if target is None:
                target = _RefBin(budget_tokens)
                bins.append(target)
            target.free_tokens -= slot
            target.doc_indices.append(index)
        open_bins = [b for b in bins if not b.carried and b.free_tokens > 0]
        open_bins.sort(key=lambda b: -b.free_tokens)  # stable: older bin first on ties
        keep = open_bins[:carry]
        for b in keep:
            b.carried = True
        outputs.extend(("bin", tuple(b.doc_indices)) for b in bins if all(b is not k for k in keep))
        return keep

    for index, n in enumerate(lengths):
        if n == 0:
            outputs.append(("error", (index,)))
        elif n > budget_tokens:
            outputs.append(("oversize", (index,)))
        else:
            window.append(index)
            if len(window) == window_docs:
                carried = place(carry_open_bins)
                window = []
    place(0)
    return outputs


def summarize(outputs: Sequence[PackerOutput]) -> list[tuple[str, tuple[int, ...]]]:
    summary: list[tuple[str, tuple[int, ...]]] = []
    for item in outputs:
        if isinstance(item, DocumentError):
            summary.append(("error", (item.index,)))
        else:
            real = tuple(i for i in item.doc_indices if i != PADDING_DOC_INDEX)
            summary.append(("oversize" if item.oversize else "bin", real))
    return summary


# ------------------------------------------------------------------ tests


def test_every_document_lands_exactly_once_within_budget() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=500).tolist()
    packer = FirstFitDecreasingPacker(budget_tokens=512, window_docs=64)
    outputs = list(packer.pack(make_documents(lengths)))
    packed = bins_of(outputs)
    assert len(packed) == len(outputs)
    placed = sorted(i for b in packed for i in b.doc_indices)
    assert placed == list(range(len(lengths)))
    for b in packed:
        check_bin_layout(b, packer)
        assert b.num_padding_tokens == 0
        assert not b.oversize


@pytest.mark.parametrize("align_to", [None, 16])
@pytest.mark.parametrize("carry_open_bins", [0, 1, 3])
def test_matches_reference_first_fit_decreasing(align_to: int | None, carry_open_bins: int) -> None:
    rng = np.random.default_rng(1)
    # Lengths over a 50x range, plus empty and oversize documents in the stream.
    lengths = rng.integers(5, 250, size=400).tolist()
    lengths[7] = 0
    lengths[100] = 1000
    packer = FirstFitDecreasingPacker(
        budget_tokens=256, window_docs=50, align_to=align_to, carry_open_bins=carry_open_bins
    )
    outputs = list(packer.pack(make_documents(lengths)))
    assert summarize(outputs) == reference_outputs(lengths, 256, 50, align_to, carry_open_bins)


def test_within_a_window_longest_goes_first_into_first_bin_with_room() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=10, window_docs=100, carry_open_bins=0)
    outputs = list(packer.pack(make_documents([2, 7, 5, 3, 4, 1])))
    # Sorted: 7 5 4 3 2 1 -> [7 3], [5 4 1], [2].
    assert [b.doc_indices for b in bins_of(outputs)] == [(1, 3), (2, 4, 5), (0,)]


def test_positions_restart_per_document_and_cu_seqlens_match() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=32, window_docs=8)
    (packed,) = bins_of(list(packer.pack(make_documents([3, 5, 2]))))
    assert packed.seq_lens == (5, 3, 2)
    assert packed.doc_indices == (1, 0, 2)
    assert packed.cu_seqlens.tolist() == [0, 5, 8, 10]
    assert packed.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert packed.token_ids.tolist() == [1000, 1001, 1002, 1003, 1004, 0, 1, 2, 2000, 2001]
    assert packed.num_tokens == 10
    check_bin_layout(packed, packer)


def test_alignment_is_its_own_padding_segment_and_counted() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=64, window_docs=8, align_to=16, pad_token_id=7)
    (packed,) = bins_of(list(packer.pack(make_documents([20, 16, 1]))))
    assert packed.seq_lens == (20, 12, 16, 1, 15)
    assert packed.doc_indices == (0, PADDING_DOC_INDEX, 1, 2, PADDING_DOC_INDEX)
    assert packed.documents[1] is None and packed.documents[4] is None
    assert packed.num_tokens == 64
    assert packed.num_padding_tokens == 27
    assert packed.num_documents == 3
    # Every document's slot (itself and its padding) starts and ends on a multiple of 16.
    slot_starts = [
        s
        for s, i in zip(packed.cu_seqlens[:-1].tolist(), packed.doc_indices, strict=True)
        if i >= 0
    ]
    assert all(start % 16 == 0 for start in slot_starts)
    assert packed.num_tokens % 16 == 0
    check_bin_layout(packed, packer)


def test_alignment_rounding_counts_toward_the_budget() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=32, window_docs=8, align_to=16)
    # Unaligned, 17 + 15 fit in 32; aligned, the slots are 32 + 16 and do not.
    packed = bins_of(list(packer.pack(make_documents([17, 15]))))
    assert [b.doc_indices for b in packed] == [(0, PADDING_DOC_INDEX), (1, PADDING_DOC_INDEX)]
    assert [b.num_padding_tokens for b in packed] == [15, 1]


def test_budget_must_be_a_multiple_of_the_alignment() -> None:
    with pytest.raises(ValueError, match="multiple of align_to"):
        FirstFitDecreasingPacker(budget_tokens=100, window_docs=8, align_to=16)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"budget_tokens": 0, "window_docs": 8},
        {"budget_tokens": 64, "window_docs": 0},
        {"budget_tokens": 64, "window_docs": 8, "align_to": 0},
        {"budget_tokens": 64, "window_docs": 8, "carry_open_bins": -1},
    ],
)
def test_rejects_bad_configuration(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        FirstFitDecreasingPacker(**kwargs)


def test_oversize_document_comes_out_alone_flagged_and_unpadded() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=32, window_docs=8, align_to=16)
    outputs = list(packer.pack(make_documents([10, 33, 5, 100])))
    oversize = [b for b in bins_of(outputs) if b.oversize]
    assert [b.doc_indices for b in oversize] == [(1,), (3,)]
    assert [b.num_tokens for b in oversize] == [33, 100]
    assert all(b.num_padding_tokens == 0 for b in oversize)
    for b in bins_of(outputs):
        check_bin_layout(b, packer)
    normal = [b for b in bins_of(outputs) if not b.oversize]
    assert sorted(i for b in normal for i in b.doc_indices if i >= 0) == [0, 2]


def test_empty_documents_become_error_records_in_order() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=32, window_docs=4)
    outputs = list(packer.pack(make_documents([3, 0, 4, 0, 5, 6, 0])))
    errors = [item for item in outputs if isinstance(item, DocumentError)]
    assert [e.index for e in errors] == [1, 3, 6]
    assert "document 3" in errors[1].message
    placed = sorted(i for b in bins_of(outputs) for i in b.doc_indices)
    assert placed == [0, 2, 4, 5]


def test_error_records_from_the_reader_pass_through_in_order() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=32, window_docs=100)
    stream: list[Document | DocumentError] = [
        Document(0, [1, 2]),
        DocumentError(1, "could not decode"),
        Document(2, [3]),
        DocumentError(3, "too long"),
    ]
    outputs = list(packer.pack(stream))
    assert outputs[:2] == [DocumentError(1, "could not decode"), DocumentError(3, "too long")]
    assert bins_of(outputs)[0].doc_indices == (0, 2)


def test_a_corpus_larger_than_the_window_streams_with_bounded_memory() -> None:
    window_docs, carry_open_bins, budget_tokens = 32, 1, 256
    num_documents = 2000
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 200, size=num_documents).tolist()
    consumed = 0

    def reader() -> Iterator[Document]:
        nonlocal consumed
        for index, n in enumerate(lengths):
            consumed += 1  # counted before the packer receives it
            yield Document(index, np.ones(n, dtype=np.int64))

    packer = FirstFitDecreasingPacker(
        budget_tokens, window_docs=window_docs, carry_open_bins=carry_open_bins
    )
    emitted = 0
    max_held = 0
    for packed in packer.pack(reader()):
        assert isinstance(packed, PackedBin)
        max_held = max(max_held, consumed - emitted)
        emitted += packed.num_documents
    assert emitted == num_documents
    # A full window plus the documents of the carried bin(s) at most (one more doc being read).
    max_docs_per_bin = max(b.num_documents for b in bins_of(list(packer.pack(reader()))))
    assert max_held <= window_docs + carry_open_bins * max_docs_per_bin + 1
    assert max_held < num_documents / 10


def test_carrying_an_open_bin_fills_bins_better() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(10, 500, size=3000).tolist()

    def num_bins(carry_open_bins: int) -> int:
        packer = FirstFitDecreasingPacker(1024, window_docs=100, carry_open_bins=carry_open_bins)
        return len(bins_of(list(packer.pack(make_documents(lengths)))))

    lower_bound = -(-sum(lengths) // 1024)
    assert num_bins(1) < num_bins(0)
    assert num_bins(1) <= lower_bound * 1.01


def test_document_accepts_lists_tuples_tensors_and_arrays() -> None:
    expected = np.array([5, 6, 7], dtype=np.int64)
    for token_ids in ([5, 6, 7], (5, 6, 7), torch.tensor([5, 6, 7]), np.array([5, 6, 7], np.int32)):
        document = Document(0, token_ids)  # type: ignore[arg-type]
        assert document.token_ids.dtype == np.int64
        assert np.array_equal(document.token_ids, expected)
        assert document.num_tokens == 3
    assert Document(1, []).num_tokens == 0


def test_document_rejects_non_1d_or_non_integer_token_ids() -> None:
    with pytest.raises(ValueError, match="document 4"):
        Document(4, np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="integers"):
        Document(5, np.zeros(3, dtype=np.float32))


def test_payload_travels_with_the_document() -> None:
    packer = FirstFitDecreasingPacker(budget_tokens=32, window_docs=4)
    (packed,) = bins_of(list(packer.pack([Document(0, [1, 2, 3], payload={"start": 2})])))
    assert packed.documents[0] is not None and packed.documents[0].payload == {"start": 2}


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=120), max_size=80),
    budget_units=st.integers(min_value=1, max_value=8),
    window_docs=st.integers(min_value=1, max_value=20),
    align_to=st.sampled_from([None, 1, 4, 16]),
    carry_open_bins=st.integers(min_value=0, max_value=3),
)
def test_properties_over_random_lengths(
    lengths: list[int],
    budget_units: int,
    window_docs: int,
    align_to: int | None,
    carry_open_bins: int,
) -> None:
    budget_tokens = budget_units * 16
    packer = FirstFitDecreasingPacker(
        budget_tokens,
        window_docs,
        align_to=align_to,
        pad_token_id=3,
        carry_open_bins=carry_open_bins,
    )
    outputs = list(packer.pack(make_documents(lengths)))
    assert summarize(outputs) == reference_outputs(
        lengths, budget_tokens, window_docs, align_to, carry_open_bins
    )
    seen: list[int] = []
    for item in outputs:
        if isinstance(item, DocumentError):
            assert lengths[item.index] == 0
            seen.append(item.index)
            continue
        check_bin_layout(item, packer)
        real = [i for i in item.doc_indices if i != PADDING_DOC_INDEX]
        seen.extend(real)
        if item.oversize:
            assert len(real) == 1 and lengths[real[0]] > budget_tokens
        else:
            assert all(0 < lengths[i] <= budget_tokens for i in real)
            slots = sum(slot_tokens(lengths[i], align_to) for i in real)
            assert item.num_tokens == slots
            assert item.num_padding_tokens == slots - sum(lengths[i] for i in real)
    assert sorted(seen) == list(range(len(lengths)))
