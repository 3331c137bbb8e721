"""Top-k, top-p and min-p on a CPU (candidates first, then the nucleus kernel or more
candidates and a whole-row sort) against the whole-row sort every row could take, and the
nucleus kernel against float64."""

from __future__ import annotations

import pytest
import torch

from vacpack.cpu_kernels.nucleus import nucleus_cut, nucleus_cut_supported
from vacpack.engine import truncation
from vacpack.engine.truncation import (
    CANDIDATE_TIERS,
    _sorted_top_k_top_p,
    apply_min_p,
    apply_top_k_top_p,
)

VOCAB_SIZE = 20_000


def _rows(generator: torch.Generator) -> torch.Tensor:
    """Peaked rows (a trained model's: settled by the first candidates), flatter ones and flat
    ones (past the first candidates: the nucleus kernel, else the second tier and, for p =
    0.99 on the flat ones, a whole sort)."""
    logits = torch.randn(9, VOCAB_SIZE, generator=generator)
    logits[:3, :30] += 10 + torch.randn(3, 30, generator=generator)
    logits[3:6] *= 2.5
    return logits


def _truncate(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    top_k = torch.tensor([float(k) for k in ks])
    top_p = torch.tensor(ps, dtype=torch.float32)
    return apply_top_k_top_p(logits, top_k, top_p, ks, ps)


@pytest.fixture(params=["nucleus kernel", "candidates only"])
def nucleus_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways past the first candidates: the nucleus kernel, else 4,096 candidates and the
    sort."""
    if request.param == "nucleus kernel":
        if not nucleus_cut_supported(torch.zeros(1, 1)):
            pytest.skip("the nucleus kernel does not build here")
    else:
        monkeypatch.setattr(truncation, "nucleus_cut_supported", lambda _: False)
    return str(request.param)


def test_equals_the_whole_row_sort_on_every_kind_of_row(nucleus_path: str) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = _rows(generator)
    off = VOCAB_SIZE
    settings = [
        ([off] * 9, [0.9] * 9),
        ([off] * 9, [0.99] * 9),
        ([40] * 9, [1.0] * 9),
        (
            [5, off, 300, off, 7, off, 1000, off, 50],
            [0.5, 0.95, 1.0, 0.8, 1.0, 0.99, 0.9, 1.0, 0.7],
        ),
        # A top-k beyond the first tier's candidates.
        ([CANDIDATE_TIERS[0] + 100] * 9, [0.999] * 9),
    ]
    for ks, ps in settings:
        out = _truncate(logits, ks, ps)
        expected = _sorted_top_k_top_p(
            logits, torch.tensor([float(k) for k in ks]), torch.tensor(ps, dtype=torch.float32)
        )
        assert torch.equal(torch.isinf(out), torch.isinf(expected)), (ks, ps)
        assert torch.equal(out[~torch.isinf(out)], logits[~torch.isinf(out)])
    # The flat rows' nucleus at 0.99 reaches past every tier of candidates, and still some
    # tokens were cut.
    flat = _truncate(logits, [off] * 9, [0.99] * 9)[6:]
    assert (torch.isinf(flat).sum(dim=1) > 0).all()
    assert (torch.isfinite(flat).sum(dim=1) > CANDIDATE_TIERS[-1]).all()


def test_rows_with_nothing_to_cut_are_untouched() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    out = _truncate(logits, [500, 500, 500], [1.0, 1.0, 1.0])
    assert torch.equal(out, logits)


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = torch.zeros(2, 5000)
    logits[0, :3] = 1.0  # the top 3, then 4,997 tokens tied for the 4th place
    logits[1] = torch.arange(5000.0)
    out = _truncate(logits, [5, 5], [1.0, 1.0])
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).sum() == 5 and torch.isfinite(out[1, -5:]).all()


def test_min_p_as_a_logit_threshold_equals_the_probability_rule() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 3000, generator=generator) * 3
    min_p = torch.tensor([0.0, 0.01, 0.1, 0.9])
    out = apply_min_p(logits, min_p)
    probs = torch.softmax(logits, dim=-1)
    dropped = probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    assert torch.equal(torch.isinf(out), dropped)
    assert torch.isfinite(out[0]).all()


def _float64_nucleus(row: torch.Tensor, top_p: float) -> int:
    """How many tokens the top-p rule keeps, summed in float64."""
    probs = torch.softmax(row.double().sort(descending=True).values, dim=0)
    return int(((probs.cumsum(0) - probs) < top_p).sum())


@pytest.mark.skipif(not nucleus_cut_supported(torch.zeros(1, 1)), reason="needs a C compiler")
@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])
def test_nucleus_kernel_keeps_what_float64_keeps(scale: float) -> None:
    generator = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, 151_936, generator=generator) * scale
    logits[0, :20] += 15  # a peaked row among flat ones
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 0.1, 0.999999])
    cut = nucleus_cut(logits, top_p)
    kept = (logits >= cut.unsqueeze(1)).sum(dim=1).tolist()
    assert kept == [_float64_nucleus(row, p) for row, p in zip(logits, top_p.tolist(), strict=True)]


@pytest.mark.skipif(not nucleus_cut_supported(torch.zeros(1, 1)), reason="needs a C compiler")
def test_nucleus_kernel_leaves_rows_without_a_finite_maximum_or_with_nan() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))
    logits[0] = float("-inf")
    logits[1, 10] = float("inf")
    logits[2, 5] = float("nan")
    cut = nucleus_cut(logits, torch.full((4,), 0.9))
    assert torch.isnan(cut[:3]).all() and torch.isfinite(cut[3])
    # Such rows go to the sort in the sampler's truncation, as before.
    ks = [1000] * 4
    out = _truncate(logits, ks, [0.9] * 4)
    expected = _sorted_top_k_top_p(logits, torch.full((4,), 1000.0), torch.full((4,), 0.9))
    assert torch.equal(torch.isinf(out[3]), torch.isinf(expected[3]))
