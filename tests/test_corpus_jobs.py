"""Corpus jobs on decoders: log-likelihoods and embeddings equal transformers; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from vacpack import LLM
from vacpack.cli import main
from vacpack.corpus.packing import DocumentError
from vacpack.corpus.tasks import LoglikelihoodTask
from vacpack.outputs import embeddings_array

BUDGET_TOKENS = 64  # small: several documents per bin, and some longer than a bin


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_num_batched_tokens=BUDGET_TOKENS)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _texts(num_texts: int, seed: int) -> list[str]:
    words = ["the", "cat", "sat", "on", "a", "warm", "mat", "while", "rain", "fell", "over"]
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (num_texts,), generator=generator).tolist()
    return [
        " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=generator))
        for n in lengths
    ]


def _reference_logprobs(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1)


def test_rolling_loglikelihood_equals_transformers(llm: LLM, reference) -> None:
    texts = _texts(24, seed=0)
    texts.append(" ".join(["rivers and hills"] * 60))  # ~180 tokens: longer than a bin
    results = llm.loglikelihood(texts, return_token_logprobs=True, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.eos_token_id  # this tokenizer has no BOS
    for text, result in zip(texts, results, strict=True):
        token_ids = [prefix, *tokenizer.encode(text, add_special_tokens=False)]
        expected = _reference_logprobs(reference, token_ids)
        assert result.num_tokens == len(token_ids) - 1
        assert result.is_greedy is None
        assert torch.allclose(torch.tensor(result.token_logprobs), expected, atol=1e-4)
        assert result.logprob == pytest.approx(float(expected.sum()), abs=1e-3)
    report = llm.corpus_runner.last_report
    assert report.bin_budget_tokens == BUDGET_TOKENS
    assert report.num_bins < len(texts)  # documents shared bins
    assert report.padding_overhead == 0.0


def test_continuations_score_and_greedy_flag(llm: LLM, reference) -> None:
    tokenizer = llm.get_tokenizer()
    contexts = ["the cat sat on", "rain fell over quiet", "a warm mat while "]
    continuations = [" a warm mat", " hills", "rain"]
    results = llm.loglikelihood(contexts, continuations, use_tqdm=False)
    for context, continuation, result in zip(contexts, continuations, results, strict=True):
        stripped = context.rstrip()
        moved = context[len(stripped) :] + continuation
        context_ids = tokenizer.encode(stripped, add_special_tokens=False)
        whole = tokenizer.encode(stripped + moved, add_special_tokens=False)
        expected = _reference_logprobs(reference, whole)[len(context_ids) - 1 :]
        assert result.num_tokens == len(whole) - len(context_ids)
        assert result.logprob == pytest.approx(float(expected.sum()), abs=1e-3)
        with torch.no_grad():
            logits = reference(torch.tensor([whole])).logits[0]
        greedy = logits[len(context_ids) - 1 : -1].argmax(-1).tolist() == whole[len(context_ids) :]
        assert result.is_greedy is greedy


def test_the_greedy_continuation_is_greedy(llm: LLM, reference) -> None:
    tokenizer = llm.get_tokenizer()
    # Find a context whose greedy next token survives a round trip through text (a random
    # model often prefers tokens that are partial UTF-8 bytes, which do not).
    for context in _texts(40, seed=5):
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        with torch.no_grad():
            next_id = int(reference(torch.tensor([context_ids])).logits[0, -1].argmax())
        continuation = tokenizer.decode([next_id])
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        if not continuation.startswith(" ") and whole[len(context_ids) :] == [next_id]:
            break
    else:
        pytest.fail("no context with a round-tripping greedy token")
    (result,) = llm.loglikelihood([context], [continuation], use_tqdm=False)
    assert result.is_greedy is True and result.num_tokens == 1


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_embeddings_equal_transformers_hidden_states(
    llm: LLM, reference, pooling: str
) -> None:
    texts = _texts(10, seed=1)
    outputs = llm.embed(texts, pooling=pooling, normalize=False, use_tqdm=False)
    vectors = embeddings_array(outputs)
    assert vectors.shape == (len(texts), llm.loaded.config.hidden_size)
    for text, vector, output in zip(texts, vectors, outputs, strict=True):
        token_ids = llm.get_tokenizer().encode(text)
        assert output.prompt_token_ids == token_ids
        with torch.no_grad():
            hidden = reference.model(torch.tensor([token_ids])).last_hidden_state[0]
        expected = hidden[-1] if pooling == "last" else hidden.mean(0)
        assert torch.allclose(torch.from_numpy(vector), expected, atol=1e-4)


def test_normalized_embeddings_have_unit_length(llm: LLM) -> None:
    vectors = embeddings_array(llm.embed(_texts(5, seed=2), normalize=True, use_tqdm=False))
    assert torch.allclose(torch.from_numpy(vectors).norm(dim=-1), torch.ones(5), atol=1e-5)


def test_bad_documents_fail_alone_and_the_job_goes_on(llm: LLM) -> None:
    texts = ["a fine document", "", "another fine one", "   "]
    task = LoglikelihoodTask(llm.loaded)
    results = dict(llm.corpus_runner.run(task, texts, use_tqdm=False))
    assert [i for i, r in results.items() if isinstance(r, DocumentError)] == [1, 3]
    assert "empty" in results[1].message
    assert results[0].num_tokens > 0 and results[2].num_tokens > 0
    assert llm.corpus_runner.last_report.num_failed == 2
    with pytest.raises(ValueError, match="2 of 4 inputs failed"):
        llm.loglikelihood(texts, use_tqdm=False)


def test_token_ids_outside_the_vocabulary_fail_alone(llm: LLM) -> None:
    # Before, an id past the embedding table failed the bin's forward: every document in it.
    vocab_size = llm.loaded.config.vocab_size
    inputs = [[1, 2, 3], [vocab_size], "a fine document", [5, -1]]
    results = llm.embed(inputs, use_tqdm=False, return_failures=True)
    failed = [i for i, r in enumerate(results) if isinstance(r, DocumentError)]
    assert failed == [1, 3]
    assert f"[0, {vocab_size})" in results[1].message and "[-1]" in results[3].message
    assert llm.corpus_runner.last_report.num_failed == 2


def test_a_model_without_the_needed_head_is_named(llm: LLM) -> None:
    with pytest.raises(ValueError, match="classification head"):
        llm.classify(["hello"], use_tqdm=False)


def test_documents_longer_than_the_context_need_truncation(tiny_checkpoint) -> None:
    short = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=32)
    long_text = " ".join(["rain"] * 100)
    with pytest.raises(ValueError, match="truncate=True"):
        short.loglikelihood([long_text], use_tqdm=False)
    (result,) = short.loglikelihood([long_text], truncate=True, use_tqdm=False)
    assert result.num_tokens == 31  # the prefix token plus 31 scored tokens fill the context


def test_the_truncation_hint_names_the_command_line_flag_too(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """A command-line user cannot pass truncate=True: a document's error names --truncate."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(["rain"] * 100) + "\n")
    output = tmp_path / "out.jsonl"
    argv = ["loglikelihood", "--model", str(tiny_checkpoint("qwen2")), "--dtype", "float32",
            "--max-model-len", "32", "--input", str(corpus), "--output", str(output)]  # fmt: skip
    assert main(argv) == 0
    (record,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert "pass truncate=True (--truncate on the command line)" in record["error"]
    assert main([*argv, "--overwrite", "--truncate"]) == 0
    (record,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert record["num_tokens"] == 31


def test_a_continuation_longer_than_the_context_is_not_told_to_truncate(
    tiny_checkpoint,
) -> None:
    """Only context tokens are ever dropped: truncating cannot fit such a continuation."""
    short = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=32)
    continuation = " " + " ".join(["rain"] * 100)
    for truncate in (False, True):
        with pytest.raises(ValueError, match="the continuation alone is") as raised:
            short.loglikelihood(["the sky"], [continuation], truncate=truncate, use_tqdm=False)
        assert "truncate" not in str(raised.value)
