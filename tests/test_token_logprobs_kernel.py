"""The scoring kernel (token_logprobs.c: a target's log-probability, rank and the row's argmax
from one read of each row) against torch's log-softmax, gather and argmax, and the engine's
logprobs through it against the log-softmax path."""

from __future__ import annotations

import pytest
import torch

from vacpack.cpu_kernels.token_logprobs import token_logprobs, token_logprobs_supported
from vacpack.engine import logprob_gather
from vacpack.engine.logprob_gather import gather_logprobs, logprobs_of

pytestmark = pytest.mark.skipif(
    not token_logprobs_supported(torch.zeros(1, 1)), reason="needs a C compiler"
)


def _expected(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """In float64: the kernel sums in double, closer to it than torch's float32 is."""
    log_softmax = torch.log_softmax(logits.double(), dim=-1)
    return log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1)


def _expected_ranks(logits: torch.Tensor, targets: torch.Tensor) -> list[int]:
    target_logits = logits.gather(1, targets.unsqueeze(1))
    return (logits >= target_logits).sum(dim=1).tolist()


# Vocabularies below a vector, across the 1,024-value chunks, and a tail after whole vectors.
@pytest.mark.parametrize("vocab", [1, 7, 16, 1024, 1025, 5003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_log_softmax_and_argmax_on_strided_rows(vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    # Rows of a wider tensor (a stride past the vocabulary), logits the size a model's are.
    wide = torch.randn(9, vocab + 5, generator=generator) * 4
    logits = wide[:, 2 : vocab + 2].to(dtype)
    targets = torch.randint(0, vocab, (9,), generator=generator)
    targets[::3] = logits.float().argmax(-1)[::3]

    scores = token_logprobs(logits, targets, with_logsumexp=True, with_ranks=True, with_argmax=True)

    assert scores.logprobs.dtype == torch.float32
    assert torch.allclose(scores.logprobs.double(), _expected(logits, targets), atol=2e-6)
    assert scores.logsumexp is not None and scores.ranks is not None
    expected_logsumexp = torch.logsumexp(logits.double(), dim=-1)
    assert torch.allclose(scores.logsumexp.double(), expected_logsumexp, atol=2e-6, rtol=1e-6)
    assert scores.ranks.tolist() == _expected_ranks(logits, targets)
    assert scores.argmax is not None
    assert scores.argmax.tolist() == logits.argmax(-1).tolist()
    alone = token_logprobs(logits, targets)
    assert alone.logsumexp is None and alone.ranks is None and alone.argmax is None
    assert torch.equal(alone.logprobs, scores.logprobs)


@pytest.mark.parametrize("top_k", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_equals_the_log_softmax_top_k(top_k: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(top_k)
    logits = (torch.randn(7, 5003, generator=generator) * 4).to(dtype)
    logits[1, 4000:] += 30  # the best ones late in the row: kept ones pushed out
    logits[2] = torch.arange(5003, dtype=dtype)  # each chunk beats the last
    logits[3] = -torch.arange(5003, dtype=dtype)  # the first ones best, later chunks not read
    if dtype == torch.float32:  # no ties among the best, so the order is the same
        logits[1] += torch.arange(5003) * 1e-3
    targets = torch.randint(0, 5003, (7,), generator=generator)

    scores = token_logprobs(logits, targets, top_k=top_k)

    expected_logprobs, expected_ids = torch.log_softmax(logits.double(), dim=-1).topk(top_k)
    assert scores.top_ids.shape == scores.top_logprobs.shape == (7, top_k)
    assert torch.allclose(scores.top_logprobs.double(), expected_logprobs, atol=2e-6)
    if dtype == torch.float32:
        assert scores.top_ids.tolist() == expected_ids.tolist()
    else:  # bf16 rounds many logits to the same value: equal ones go in token order
        picked = logits.gather(1, scores.top_ids)
        assert torch.equal(picked, logits.topk(top_k).values)


def test_top_k_ties_go_in_token_order_and_nan_rows_are_torchs() -> None:
    logits = torch.zeros(3, 3000)
    logits[0, [5, 2000, 70, 2999]] = 1.0
    logits[1, 17] = float("nan")
    logits[2] = 2.0  # all tied: the first tokens
    scores = token_logprobs(logits, torch.tensor([0, 0, 0]), top_k=3)
    assert scores.top_ids[0].tolist() == [5, 70, 2000]
    assert scores.top_ids[2].tolist() == [0, 1, 2]
    expected = torch.log_softmax(logits[1:2], -1).topk(3)
    assert scores.top_ids[1].tolist() == expected.indices[0].tolist()
    assert torch.isnan(scores.top_logprobs[1]).all()
    whole = token_logprobs(logits[:1], torch.tensor([0]), top_k=3000)
    assert sorted(whole.top_ids[0].tolist()) == list(range(3000))
    with pytest.raises(ValueError, match="top_k 3001 is not within the vocabulary of 3000"):
        token_logprobs(logits, torch.tensor([0, 0, 0]), top_k=3001)


def test_ties_go_to_the_lowest_index_across_chunks() -> None:
    generator = torch.Generator().manual_seed(0)
    # Few distinct values over 3,000 columns: the maximum recurs in every chunk and lane.
    logits = torch.randint(0, 4, (16, 3000), generator=generator).float()
    logits[3, 2999] = 9.0  # a maximum in the scalar tail alone
    logits[4, :] = 1.0  # one value everywhere: index 0
    targets = torch.randint(0, 3000, (16,), generator=generator)
    scores = token_logprobs(logits, targets, with_ranks=True, with_argmax=True)
    assert scores.argmax is not None and scores.ranks is not None
    assert scores.argmax.tolist() == logits.argmax(-1).tolist()
    # A token tied with others ranks behind all of them.
    assert scores.ranks.tolist() == _expected_ranks(logits, targets)
    assert scores.ranks[4] == 3000
    assert torch.allclose(scores.logprobs.double(), _expected(logits, targets), atol=2e-6)


def test_rows_with_nan_or_infinities_score_as_torch_does() -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [1.0, 2.0, nan, 3.0, nan],  # NaN: NaN, argmax the first NaN
            [-inf] * 5,  # nothing possible: NaN
            [inf, 1.0, 2.0, 3.0, 4.0],  # inf - inf: NaN
            [0.0, -inf, 2.0, 2.0, -inf],  # impossible tokens weigh nothing
        ]
    )
    targets = torch.tensor([0, 1, 1, 2])
    scores = token_logprobs(logits, targets, with_ranks=True, with_argmax=True)
    log_softmax = torch.log_softmax(logits, -1)
    expected = log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1)
    assert torch.allclose(scores.logprobs, expected, equal_nan=True)
    assert torch.isnan(scores.logprobs[:3]).all()
    assert scores.argmax is not None and scores.ranks is not None
    assert scores.argmax.tolist() == logits.argmax(-1).tolist()
    assert scores.ranks.tolist() == gather_logprobs(log_softmax, targets, 0).token_ranks.tolist()


def test_bad_targets_are_refused() -> None:
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="outside the vocabulary of 10"):
        token_logprobs(logits, torch.tensor([3, 10]), with_argmax=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_logprobs(logits, torch.tensor([-1, 0]), with_argmax=False)
    with pytest.raises(ValueError, match=r"targets \(3,\) for 2 rows"):
        token_logprobs(logits, torch.tensor([0, 1, 2]), with_argmax=False)


def test_no_rows_give_empty_results() -> None:
    scores = token_logprobs(
        torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64), with_ranks=True, with_argmax=True
    )
    assert scores.logprobs.shape == (0,)
    assert scores.ranks is not None and scores.ranks.shape == (0,)
    assert scores.argmax is not None and scores.argmax.shape == (0,)


@pytest.mark.parametrize("num_topk", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_logprobs_equal_the_log_softmax_path(num_topk: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(num_topk)
    logits = (torch.randn(6, 3001, generator=generator) * 3).to(dtype)
    logits[0, :40] = logits[0].max() + 1  # a token tied for first ranks behind the others tied
    token_ids = torch.randint(0, 3001, (6,), generator=generator)
    token_ids[0] = 7

    fast = logprobs_of(logits, token_ids, num_topk)
    reference = gather_logprobs(torch.log_softmax(logits.float(), -1), token_ids, num_topk)

    assert torch.allclose(fast.token_logprobs, reference.token_logprobs, atol=1e-5)
    assert fast.token_ranks.tolist() == reference.token_ranks.tolist()
    assert fast.token_ranks[0] == 40
    assert fast.topk_token_ids.shape == reference.topk_token_ids.shape == (6, num_topk)
    assert torch.allclose(fast.topk_logprobs, reference.topk_logprobs, atol=1e-5)
    # Ties aside (row 0, and bf16's rounding), the same top tokens in the same order.
    if dtype == torch.float32:
        assert fast.topk_token_ids[1:].tolist() == reference.topk_token_ids[1:].tolist()
    assert fast.topk_token_ids[0].tolist() == list(range(num_topk))


def test_engine_logprobs_without_the_kernel_take_the_log_softmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logprob_gather, "token_logprobs_supported", lambda _: False)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    token_ids = torch.tensor([0, 10, 49])
    gathered = logprobs_of(logits, token_ids, 2)
    reference = gather_logprobs(torch.log_softmax(logits, -1), token_ids, 2)
    for field in ("token_logprobs", "token_ranks", "topk_token_ids", "topk_logprobs"):
        assert torch.equal(getattr(gathered, field), getattr(reference, field))
