"""XLM-RoBERTa encoders, cross-encoder rerankers and decoder embedding models, through LLM.embed
and LLM.score, against sentence-transformers (SentenceTransformer, CrossEncoder) and
transformers: tiny random-weight models built here, and the real all-MiniLM-L6-v2 weights."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from vacpack import LLM
from vacpack.cli import main
from vacpack.models.pooling import check_dimensions
from vacpack.outputs import embeddings_array
from vacpack.testing.packed_forward import load_for_test, packed_forward
from vacpack.testing.tiny_encoders import (
    build_tiny_bert,
    build_tiny_decoder_embedding,
    build_tiny_xlm_roberta,
    minilm_dir,
    write_sentence_transformers_files,
)
from vacpack.testing.tiny_models import TOKENIZER_CORPUS_PATH, build_tiny_classifier_checkpoint

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"


def _texts(count: int, seed: int, max_words: int = 60) -> list[str]:
    words = TOKENIZER_CORPUS_PATH.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        num_words = rng.randint(1, max_words)
        start = rng.randrange(len(words) - num_words)
        texts.append(" ".join(words[start : start + num_words]))
    return texts


def _llm(model_dir: Path, **kwargs) -> LLM:
    # A small bin budget so that every job packs several bins of several documents each.
    return LLM(str(model_dir), dtype="float32", max_num_batched_tokens=512, **kwargs)


def _min_cosine(ours: np.ndarray, reference: np.ndarray) -> float:
    cosine = F.cosine_similarity(torch.from_numpy(ours), torch.from_numpy(reference), dim=-1)
    return float(cosine.min())


def _scores(outputs) -> np.ndarray:
    return np.array([output.outputs.score for output in outputs])


# ------------------------------------------------------------------ XLM-RoBERTa embeddings


@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_xlm_roberta(tmp_path_factory.mktemp("xlmr"))


def test_xlmr_hidden_states_equal_transformers(xlmr_dir: Path) -> None:
    """Position ids start after the padding row and skip padding tokens, per packed sequence."""
    tokenizer = AutoTokenizer.from_pretrained(xlmr_dir)
    sequences = tokenizer(_texts(6, seed=0))["input_ids"]
    sequences.append([0, 57, 1, 1, 88, 2])  # padding tokens inside a sequence
    model = load_for_test(xlmr_dir)
    assert model.config.max_position_embeddings == 512  # 514 rows, offset 2
    hidden = packed_forward(model, sequences)
    reference_model = AutoModel.from_pretrained(xlmr_dir).eval()
    with torch.no_grad():
        reference = torch.cat(
            [reference_model(torch.tensor([s])).last_hidden_state[0] for s in sequences]
        )
    torch.testing.assert_close(hidden, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("pooling_mode", "shape"), [("cls", "bge-m3"), ("mean", "multilingual-e5")]
)
def test_xlmr_embeddings_equal_sentence_transformers(
    xlmr_dir: Path, tmp_path: Path, pooling_mode: str, shape: str
) -> None:
    model_dir = shutil.copytree(xlmr_dir, tmp_path / shape)
    write_sentence_transformers_files(model_dir, pooling_mode, normalize=True)
    texts = _texts(30, seed=1, max_words=100)
    ours = embeddings_array(_llm(model_dir).embed(texts, use_tqdm=False))
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(texts)
    assert _min_cosine(ours, reference) >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


# ------------------------------------------------------------------ cross-encoders


@pytest.fixture(scope="module")
def bert_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("bert_reranker"), num_labels=1)


@pytest.fixture(scope="module")
def xlmr_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_xlm_roberta(tmp_path_factory.mktemp("xlmr_reranker"), num_labels=1)


@pytest.fixture(scope="module")
def minilm_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real MiniLM encoder (trained token-type embeddings) under a seeded one-label head."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=1)
    with torch.no_grad():
        model.classifier.weight.normal_(std=0.5)
    out_dir = tmp_path_factory.mktemp("minilm_reranker")
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize(
    "reranker", ["bert_reranker_dir", "xlmr_reranker_dir", "minilm_reranker_dir"]
)
def test_cross_encoder_scores_equal_sentence_transformers(
    reranker: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(reranker)
    query = "what do the documents say about the river"
    documents = _texts(16, seed=2, max_words=80)
    llm = _llm(model_dir)
    one_to_many = _scores(llm.score(query, documents, use_tqdm=False))
    reference = CrossEncoder(str(model_dir), device="cpu").predict([(query, d) for d in documents])
    np.testing.assert_allclose(one_to_many, reference, atol=1e-4)
    assert np.ptp(reference) > 0.01, "scores too alike to tell a mistake apart"
    # Pairwise (N:N), and raw logits without the sigmoid.
    queries = _texts(len(documents), seed=3, max_words=12)
    pairwise = _scores(llm.score(queries, documents, use_tqdm=False))
    reference = CrossEncoder(str(model_dir), device="cpu").predict(
        list(zip(queries, documents, strict=True))
    )
    np.testing.assert_allclose(pairwise, reference, atol=1e-4)
    logits = _scores(llm.score(queries[:3], documents[:3], use_activation=False, use_tqdm=False))
    np.testing.assert_allclose(1 / (1 + np.exp(-logits)), pairwise[:3], atol=1e-5)


def test_bert_pairs_read_the_second_segment_as_token_type_1(minilm_reranker_dir: Path) -> None:
    """The same tokens read all as type 0 score differently: the types reach the model."""
    query, document = "a question about dogs", "the lazy dog sleeps in the sun all day"
    ours = _scores(_llm(minilm_reranker_dir).score(query, document, use_tqdm=False))
    reference_model = AutoModelForSequenceClassification.from_pretrained(minilm_reranker_dir)
    encoded = AutoTokenizer.from_pretrained(minilm_reranker_dir)(
        query, document, return_tensors="pt"
    )
    assert encoded["token_type_ids"].sum() > 0
    with torch.no_grad():
        as_type_0 = reference_model(encoded["input_ids"]).logits.sigmoid().item()
    assert abs(ours[0] - as_type_0) > 1e-3


def test_a_decoder_reranker_reads_the_two_texts_joined(tmp_path: Path) -> None:
    """A one-label decoder classifier scores text_1 + text_2 as one text, as vLLM's "LLM as
    reranker" does without a score template."""
    model_dir = build_tiny_classifier_checkpoint("qwen2", tmp_path / "qwen2", num_labels=1)
    llm = _llm(model_dir)
    query, documents = "a question:", _texts(5, seed=8, max_words=30)
    ours = _scores(llm.score(query, documents, use_tqdm=False))
    reference_model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = llm.get_tokenizer()
    with torch.no_grad():
        logits = [
            reference_model(torch.tensor([tokenizer.encode(query + d)])).logits[0, 0]
            for d in documents
        ]
    np.testing.assert_allclose(ours, torch.stack(logits).sigmoid().numpy(), atol=1e-5)


# ------------------------------------------------------------------ decoder embedding models


@pytest.fixture(scope="module")
def qwen3_embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("qwen3_embedding")
    prompts = {"query": QUERY_PROMPT, "document": ""}
    build_tiny_decoder_embedding(out_dir, "qwen3", prompts=prompts)
    assert json.loads((out_dir / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    return out_dir


def test_decoder_embeddings_equal_sentence_transformers(qwen3_embedding_dir: Path) -> None:
    llm = _llm(qwen3_embedding_dir)
    reference_model = SentenceTransformer(str(qwen3_embedding_dir), device="cpu")
    texts = _texts(30, seed=4, max_words=100)
    ours = embeddings_array(llm.embed(texts, use_tqdm=False))
    assert _min_cosine(ours, reference_model.encode(texts)) >= 0.9999
    # The instruction prefix, by name and given directly.
    queries = _texts(8, seed=5, max_words=10)
    reference = reference_model.encode(queries, prompt_name="query")
    by_name = embeddings_array(llm.embed(queries, prompt_name="query", use_tqdm=False))
    given = embeddings_array(llm.embed(queries, prompt=QUERY_PROMPT, use_tqdm=False))
    assert _min_cosine(by_name, reference) >= 0.9999 and np.array_equal(by_name, given)
    assert _min_cosine(by_name, embeddings_array(llm.embed(queries, use_tqdm=False))) < 0.999
    with pytest.raises(ValueError, match=r"no prompt named 'passage'.*document, query"):
        llm.embed(queries, prompt_name="passage", use_tqdm=False)
    with pytest.raises(ValueError, match="text inputs only"):
        llm.embed([[5, 6, 7]], prompt_name="query", use_tqdm=False)


def test_matryoshka_dimensions_cut_then_normalize(qwen3_embedding_dir: Path) -> None:
    llm = _llm(qwen3_embedding_dir)
    texts = _texts(6, seed=6)
    full = embeddings_array(llm.embed(texts, use_tqdm=False))
    cut = embeddings_array(llm.embed(texts, dimensions=16, use_tqdm=False))
    reference = SentenceTransformer(str(qwen3_embedding_dir), device="cpu").encode(
        texts, truncate_dim=16
    )
    assert cut.shape == (6, 16)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-5)
    assert _min_cosine(cut, reference) >= 0.9999
    with pytest.raises(ValueError, match="more than the model's embedding size 64"):
        llm.embed(texts, dimensions=65, use_tqdm=False)


def test_declared_matryoshka_dimensions_are_enforced() -> None:
    from types import SimpleNamespace

    check_dimensions(32, 64, SimpleNamespace())
    check_dimensions(32, 64, SimpleNamespace(matryoshka_dimensions=[16, 32]))
    with pytest.raises(ValueError, match=r"only the matryoshka dimensions \[16, 32\]"):
        check_dimensions(24, 64, SimpleNamespace(matryoshka_dimensions=[16, 32]))
    with pytest.raises(ValueError, match="does not support matryoshka"):
        check_dimensions(32, 64, SimpleNamespace(is_matryoshka=False))
    with pytest.raises(ValueError, match="positive integer"):
        check_dimensions(0, 64, SimpleNamespace())


def _last_token_reference(model_dir: Path, tokenizer, texts: list[str]) -> np.ndarray:
    """transformers' AutoModel: each text's last hidden state, L2-normalized."""
    reference_model = AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        last = torch.stack(
            [
                reference_model(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0, -1]
                for t in texts
            ]
        )
    return F.normalize(last, dim=-1).numpy()


def test_a_generative_model_embeds_its_last_token_normalized(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """As vLLM's embed does for decoders: last token, L2-normalized, on LLM and CLI alike."""
    model_dir = tiny_checkpoint("qwen2")
    llm = _llm(model_dir)
    texts = _texts(10, seed=7, max_words=40)
    ours = embeddings_array(llm.embed(texts, use_tqdm=False))
    reference = _last_token_reference(model_dir, llm.get_tokenizer(), texts)
    np.testing.assert_allclose(ours, reference, atol=1e-5)
    # Scoring with an embedding-capable model: the cosine similarity of the two embeddings.
    scores = _scores(llm.score(texts[0], texts[1:4], use_tqdm=False))
    np.testing.assert_allclose(scores, ours[1:4] @ ours[0], atol=1e-5)
    # The command line embeds the same way (here cut to 32 dimensions).
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:3]))
    command = ["embed", "--model", str(model_dir), "--dtype", "float32", "--input", str(corpus)]
    assert main([*command, "--output", str(tmp_path / "o"), "--dimensions", "32"]) == 0
    records = [json.loads(line) for line in (tmp_path / "o").read_text().splitlines()]
    expected = embeddings_array(llm.embed(texts[:3], dimensions=32, use_tqdm=False))
    np.testing.assert_allclose([r["embedding"] for r in records], expected, atol=1e-5)


def test_a_causal_lm_saved_without_its_head_loads_as_a_body_that_embeds(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """An untied Qwen2ForCausalLM whose files hold no lm_head (as decoder-based embedding
    models are often saved) loads as the body: it embeds as transformers' AutoModel says, and
    refuses to generate."""
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoint("qwen2", tie_word_embeddings=False)
    model_dir = tmp_path / "headless"
    shutil.copytree(source, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"
    ]

    llm = _llm(model_dir)
    texts = _texts(4, seed=3, max_words=30)
    ours = embeddings_array(llm.embed(texts, use_tqdm=False))
    reference = _last_token_reference(model_dir, llm.get_tokenizer(), texts)
    np.testing.assert_allclose(ours, reference, atol=1e-5)
    with pytest.raises(ValueError, match="generate"):
        llm.generate(["hello"], use_tqdm=False)


# ------------------------------------------------------------------ refusals


def test_wrong_model_kinds_and_shapes_are_refused(bert_reranker_dir: Path, tmp_path: Path) -> None:
    reranker = _llm(bert_reranker_dir)
    with pytest.raises(ValueError, match="classifier; embed needs an embedding model"):
        reranker.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        reranker.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="text_2 1 is empty"):
        reranker.score("a", ["c", " "], use_tqdm=False)
    three_labels = _llm(build_tiny_bert(tmp_path / "three", num_labels=3))
    with pytest.raises(ValueError, match=r"one label.*3 labels"):
        three_labels.score("a", "b", use_tqdm=False)


def test_an_unsupported_architecture_names_the_supported_ones(
    bert_reranker_dir: Path, tmp_path: Path
) -> None:
    model_dir = shutil.copytree(bert_reranker_dir, tmp_path / "gpt2")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported:") as info:
        LLM(str(model_dir), dtype="float32")
    for name in ("XLMRobertaModel", "XLMRobertaForSequenceClassification", "Qwen3Model"):
        assert name in str(info.value)
    # A model type transformers does not know either gets the same error.
    config.update(model_type="no-such-type", architectures=["NoSuchModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'NoSuchModel' is not supported; supported:.*BertModel"):
        LLM(str(model_dir), dtype="float32")
