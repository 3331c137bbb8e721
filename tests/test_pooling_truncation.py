"""vLLM's `truncate_prompt_tokens` on LLM.embed, LLM.classify and LLM.score: each input keeps its
first k tokens with the special tokens its tokenizer adds (as sentence-transformers cuts at
max_seq_length, and CrossEncoder at max_length), -1 keeps what the context holds, and a value
the model cannot take raises before any work, naming the field and its limits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from vacpack import LLM
from vacpack.outputs import embeddings_array
from vacpack.testing.tiny_encoders import build_tiny_bert, minilm_dir
from vacpack.testing.tiny_models import build_tiny_classifier_checkpoint

QUERY = "where does the river run"
TEXTS = [
    "the river runs past the old mill and into the sea",
    "a recipe for bread with flour, water and salt, baked slowly in a hot oven",
    "numbers 12345 and symbols",
]
MAX_MODEL_LEN = 64


def _llm(model_dir: Path, **kwargs: object) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_num_batched_tokens=256, **kwargs)


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return _llm(minilm_dir())


@pytest.fixture(scope="module")
def bert_embedder(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return _llm(build_tiny_bert(tmp_path_factory.mktemp("bert")), max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def bert_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("reranker"), num_labels=1)


def test_minilm_embeddings_cut_as_sentence_transformers_cuts_at_max_seq_length(
    minilm: LLM,
) -> None:
    """The real weights: [CLS] and [SEP] stay, so the vectors are sentence-transformers' own."""
    reference_model = SentenceTransformer(str(minilm_dir()), device="cpu")
    reference_model.max_seq_length = 6
    reference = reference_model.encode(TEXTS)
    outputs = minilm.embed(TEXTS, truncate_prompt_tokens=6, use_tqdm=False)
    np.testing.assert_allclose(embeddings_array(outputs), reference, atol=1e-5)
    tokenizer = minilm.get_tokenizer()
    for text, output in zip(TEXTS, outputs, strict=True):
        whole = tokenizer.encode(text)
        assert output.prompt_token_ids == [*whole[:5], tokenizer.sep_token_id]
    # Without the field, nothing changes (MiniLM still cuts at its own max_seq_length).
    untouched = embeddings_array(minilm.embed(TEXTS, use_tqdm=False))
    reference_model.max_seq_length = 256
    np.testing.assert_allclose(untouched, reference_model.encode(TEXTS), atol=1e-5)


def test_embed_keeps_the_first_tokens_of_text_and_of_token_ids(bert_embedder: LLM) -> None:
    tokenizer = bert_embedder.get_tokenizer()
    (cut,) = bert_embedder.embed([TEXTS[1]], truncate_prompt_tokens=7, use_tqdm=False)
    assert cut.prompt_token_ids == tokenizer(TEXTS[1], truncation=True, max_length=7)["input_ids"]
    assert cut.prompt_token_ids[0] == tokenizer.cls_token_id
    assert cut.prompt_token_ids[-1] == tokenizer.sep_token_id
    # The cut tokens embed as the same tokens given directly.
    (given,) = bert_embedder.embed([cut.prompt_token_ids], use_tqdm=False)
    assert given.outputs.embedding == pytest.approx(cut.outputs.embedding, abs=1e-6)
    # Token ids are the caller's own tokens: their first k are kept.
    token_ids = list(range(1000, 1020))
    (from_ids,) = bert_embedder.embed([token_ids], truncate_prompt_tokens=5, use_tqdm=False)
    assert from_ids.prompt_token_ids == token_ids[:5]


def test_minus_one_keeps_what_the_context_holds(bert_embedder: LLM) -> None:
    long_text = "word " * 200
    with pytest.raises(ValueError, match="longer than the model's context"):
        bert_embedder.embed([long_text], use_tqdm=False)
    (cut,) = bert_embedder.embed([long_text], truncate_prompt_tokens=-1, use_tqdm=False)
    assert len(cut.prompt_token_ids) == MAX_MODEL_LEN  # pooling needs no room for an output
    (short,) = bert_embedder.embed([TEXTS[0]], truncate_prompt_tokens=-1, use_tqdm=False)
    (whole,) = bert_embedder.embed([TEXTS[0]], use_tqdm=False)
    assert short.prompt_token_ids == whole.prompt_token_ids


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"truncate_prompt_tokens must be .*-1.* or in \[1, 64\] \(max_model_len\), got 0"),
        (-2, r"truncate_prompt_tokens must be .*in \[1, 64\].*got -2"),
        (MAX_MODEL_LEN + 1, r"truncate_prompt_tokens must be .*in \[1, 64\].*got 65"),
        (True, "truncate_prompt_tokens must be None or an int"),
        # [CLS] and [SEP] alone, or below them (where the tokenizer would not cut at all).
        (2, r"truncate_prompt_tokens must be -1 or in \[3, 64\].*adds 2 special tokens"),
        (1, r"truncate_prompt_tokens must be -1 or in \[3, 64\]"),
    ],
)
def test_values_the_model_cannot_take_are_refused(
    bert_embedder: LLM, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        bert_embedder.embed(TEXTS, truncate_prompt_tokens=value, use_tqdm=False)  # type: ignore[arg-type]
    # Refused before any work: the LLM goes on serving.
    assert len(bert_embedder.embed(TEXTS, truncate_prompt_tokens=3, use_tqdm=False)) == 3


def test_cross_encoder_pairs_cut_as_cross_encoder_max_length(bert_reranker_dir: Path) -> None:
    """A pair loses tokens from its longer text first; both texts' separators stay."""
    reranker = _llm(bert_reranker_dir)
    pairs = [(QUERY, text) for text in TEXTS]
    reference = CrossEncoder(str(bert_reranker_dir), device="cpu", max_length=9).predict(pairs)
    outputs = reranker.score(QUERY, TEXTS, truncate_prompt_tokens=9, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in outputs], reference, atol=1e-5)
    tokenizer = reranker.get_tokenizer()
    for text, output in zip(TEXTS, outputs, strict=True):
        expected = tokenizer(QUERY, text, truncation=True, max_length=9)["input_ids"]
        assert output.prompt_token_ids == expected
        assert output.prompt_token_ids.count(tokenizer.sep_token_id) == 2
    # [CLS] q [SEP] d [SEP] needs 5: fewer would drop a whole text (or not cut at all).
    with pytest.raises(ValueError, match=r"in \[5, 512\].*3 special tokens to each text pair"):
        reranker.score(QUERY, TEXTS, truncate_prompt_tokens=4, use_tqdm=False)


def test_an_embedding_model_scores_each_text_cut(bert_embedder: LLM) -> None:
    outputs = bert_embedder.score(QUERY, TEXTS[:2], truncate_prompt_tokens=4, use_tqdm=False)
    embedded = bert_embedder.embed([QUERY, *TEXTS[:2]], truncate_prompt_tokens=4, use_tqdm=False)
    query_vector = torch.tensor(embedded[0].outputs.embedding)
    for output, text_output in zip(outputs, embedded[1:], strict=True):
        cosine = torch.cosine_similarity(
            query_vector, torch.tensor(text_output.outputs.embedding), 0
        )
        assert output.outputs.score == pytest.approx(float(cosine), abs=1e-6)
        assert len(output.prompt_token_ids) == 8  # both texts, 4 tokens each


def test_classify_reads_the_first_tokens(tmp_path: Path) -> None:
    classifier = _llm(build_tiny_classifier_checkpoint("qwen2", tmp_path / "m"))
    tokenizer = classifier.get_tokenizer()
    cut = classifier.classify(TEXTS, truncate_prompt_tokens=3, use_tqdm=False)
    as_tokens = classifier.classify([tokenizer.encode(text)[:3] for text in TEXTS], use_tqdm=False)
    for output, expected in zip(cut, as_tokens, strict=True):
        assert output.prompt_token_ids == expected.prompt_token_ids
        assert output.outputs.probs == pytest.approx(expected.outputs.probs, abs=1e-6)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        classifier.classify(TEXTS, truncate_prompt_tokens=0, use_tqdm=False)
