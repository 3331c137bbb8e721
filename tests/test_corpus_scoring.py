"""Scoring by the C kernel or in cache-sized slices, long documents whole or chunked, and the
runner's progress."""

from __future__ import annotations

import pytest
import torch

from vacpack import LLM
from vacpack.corpus import token_logprobs as token_logprobs_module
from vacpack.corpus.budget import BinBudget
from vacpack.corpus.packing import DocumentError
from vacpack.corpus.runner import CorpusRunner
from vacpack.corpus.tasks import EmbedTask, LoglikelihoodTask, resolve_pooling
from vacpack.corpus.token_logprobs import LM_HEAD_ROWS, score_tokens
from vacpack.cpu_kernels.token_logprobs import token_logprobs_supported

VOCAB_SIZE = 1000
HIDDEN_SIZE = 16


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(params=["kernel", "log_softmax"])
def scoring_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways score_tokens scores: the C kernel where it runs, else slices of log-softmax."""
    if request.param == "kernel":
        if not token_logprobs_supported(torch.zeros(1, 1)):
            pytest.skip("the scoring kernel does not build here")
    else:
        monkeypatch.setattr(token_logprobs_module, "token_logprobs_supported", lambda _: False)
    return str(request.param)


@pytest.mark.parametrize("num_rows", [1, 31, LM_HEAD_ROWS + 45])
def test_scores_equal_one_log_softmax_over_all_rows(num_rows: int, scoring_path: str) -> None:
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(VOCAB_SIZE, HIDDEN_SIZE, generator=generator)
    hidden = torch.randn(num_rows + 7, HIDDEN_SIZE, generator=generator)
    rows = torch.randperm(num_rows + 7, generator=generator)[:num_rows]
    targets = torch.randint(0, VOCAB_SIZE, (num_rows,), generator=generator)
    # Half the targets are the argmax, so both values of the greedy flag are checked.
    logits = hidden[rows] @ weight.T
    targets[::2] = logits.argmax(-1)[::2]

    scores = score_tokens(lambda h: (h @ weight.T).float(), hidden, rows, targets, True)

    expected = torch.log_softmax(logits, -1).gather(1, targets.unsqueeze(1)).squeeze(1)
    assert torch.allclose(scores.logprobs, expected, atol=1e-5)
    assert scores.is_greedy is not None
    assert scores.is_greedy.tolist() == (logits.argmax(-1) == targets).tolist()
    no_greedy = score_tokens(lambda h: (h @ weight.T).float(), hidden, rows, targets, False)
    assert no_greedy.is_greedy is None
    assert torch.equal(no_greedy.logprobs, scores.logprobs)


def test_a_long_document_runs_whole_or_in_chunks_alike(llm: LLM) -> None:
    forward = llm.corpus_runner.forward
    token_ids = torch.randint(0, 200, (150,), generator=torch.Generator().manual_seed(0))
    whole = forward.long_document(token_ids, max_forward_tokens=150)
    chunked = forward.long_document(token_ids, max_forward_tokens=64)
    assert torch.allclose(whole, chunked, atol=1e-4)


def test_progress_counts_documents_as_their_bins_finish(llm: LLM) -> None:
    """First-fit decreasing puts the shortest document, input 0, in the last bin: counting
    only what has been yielded in input order would read 0 until the end."""
    texts = ["rain", *[" ".join(["rivers and hills"] * n) for n in range(4, 16)]]
    task = EmbedTask(llm.loaded, resolve_pooling(llm.loaded))
    runner = llm.corpus_runner
    counts_before_bin: list[int] = []
    bin_sizes: list[int] = []
    process = task.process

    def recording_process(documents, seq_lens, hidden):  # type: ignore[no-untyped-def]
        counts_before_bin.append(runner.last_report.num_documents)
        bin_sizes.append(len(documents))
        return process(documents, seq_lens, hidden)

    task.process = recording_process  # type: ignore[method-assign]
    results = list(runner.run(task, texts, use_tqdm=False))
    assert [index for index, _ in results] == list(range(len(texts)))
    assert len(bin_sizes) > 2
    assert counts_before_bin == [sum(bin_sizes[:i]) for i in range(len(bin_sizes))]
    assert runner.last_report.num_documents == len(texts)


def test_batched_encoding_equals_encoding_one_by_one(llm: LLM) -> None:
    task = EmbedTask(llm.loaded, resolve_pooling(llm.loaded))
    items = list(enumerate(["the cat sat", "", "on a warm mat", [5, 6, 7], 3.5, "  ", "rain"]))
    batched = task.encode_batch(items)
    for (index, item), result in zip(items, batched, strict=True):
        try:
            expected = task.encode(index, item)
        except ValueError as error:
            assert isinstance(result, DocumentError) and result.message == str(error)
        else:
            assert not isinstance(result, DocumentError)
            assert result.index == index and result.token_ids.tolist() == list(expected.token_ids)


def test_scoring_in_a_measured_budget_equals_a_given_one(llm: LLM) -> None:
    texts = [" ".join(["rivers and hills"] * n) for n in (2, 40, 3)]  # one longer than 64
    task = LoglikelihoodTask(llm.loaded)
    given = [r.logprob for _, r in llm.corpus_runner.run(task, texts, use_tqdm=False)]
    roomy = CorpusRunner(llm.loaded)
    roomy._budget = BinBudget(64, "test", max_forward_tokens=4096)
    whole = [r.logprob for _, r in roomy.run(task, texts, use_tqdm=False)]
    assert whole == pytest.approx(given, abs=1e-3)


def test_logits_in_the_models_dtype_are_scored_in_float32(scoring_path: str) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB_SIZE, HIDDEN_SIZE, generator=generator).bfloat16()
    hidden = torch.randn(70, HIDDEN_SIZE, generator=generator).bfloat16()
    rows = torch.arange(70)
    targets = torch.randint(0, VOCAB_SIZE, (70,), generator=generator)
    scores = score_tokens(lambda h: h @ weight.T, hidden, rows, targets, False)
    logits = (hidden @ weight.T).float()
    expected = torch.log_softmax(logits, -1).gather(1, targets.unsqueeze(1)).squeeze(1)
    assert scores.logprobs.dtype == torch.float32
    assert torch.allclose(scores.logprobs, expected, atol=1e-5)
